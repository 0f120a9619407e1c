"""Preemption with real trainers: two low-priority training jobs hold both slots, a job of
higher priority preempts them; they save, wait as ``preempted``, resume and finish, and
every step is trained exactly once."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hybridtrain.service.api import JobService
from hybridtrain.service.devices import parse_slots
from hybridtrain.service.local import LocalBackend
from hybridtrain.service.scheduler import Scheduler
from hybridtrain.service.store import JobStore
from tests.service.conftest import tiny_config, wait_for

pytestmark = pytest.mark.timeout(180)

STEPS = 1500


def _steps_logged(job_dir: str) -> list[int]:
    """The step of each record of the job's ``metrics.jsonl`` (a step's extra records, e.g.
    at a checkpoint, repeat its number)."""
    path = Path(job_dir) / "run" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def test_a_high_priority_job_preempts_both_holders_which_resume_and_train_each_step_once(
        storage: str, tmp_path: Path) -> None:
    slots = parse_slots("cpu:2")
    scheduler = Scheduler(JobStore(storage), slots, {"local": LocalBackend(slots)}, lease=5.0)
    service = JobService(scheduler.store, scheduler, tmp_path / "jobs")
    store, tick = service.store, scheduler.tick
    config = tiny_config(tmp_path / "low.yaml", steps=STEPS, checkpoint_every=1000)
    for name in ("low-a", "low-b"):
        service.submit({"name": name, "config": str(config), "priority": 0, "kill_grace": 60})
    tick()
    assert {j.name for j in store.jobs(("running",))} == {"low-a", "low-b"}
    wait_for(lambda: all(len(_steps_logged(store.get(n).job_dir)) >= 2 for n in ("low-a", "low-b")),
             90, "both low-priority jobs to train a few steps", tick)

    service.submit({"name": "urgent", "command": [sys.executable, "-c", "pass"], "devices": 2,
                    "priority": 5, "preemptible": False})
    tick()
    assert all(store.get(n).preempting for n in ("low-a", "low-b"))
    wait_for(lambda: store.get("urgent").state != "queued", 60, "'urgent' to start", tick)
    for name in ("low-a", "low-b"):
        low = store.get(name)
        assert low.history[0]["outcome"] == "preempted", low.history
        assert "preempted for urgent (priority 5 > 0): it saved a checkpoint and stopped " \
               "(exit 130)" in low.history[0]["reason"]
    wait_for(lambda: all(j.state not in ("queued", "preempted", "running") for j in store.jobs()),
             120, "every job to end", tick)

    jobs = {j.name: j for j in store.jobs()}
    assert {n: j.state for n, j in jobs.items()} == {
        "low-a": "succeeded", "low-b": "succeeded", "urgent": "succeeded"}
    for name in ("low-a", "low-b"):
        job = jobs[name]
        assert job.attempt == 2 and job.restarts == 0
        # It waited as preempted and ran only after 'urgent' had ended.
        assert job.history[0]["ended_at"] <= (jobs["urgent"].started_at or 0.0)
        assert (jobs["urgent"].finished_at or 0.0) <= (job.history[1]["started_at"] or 0.0) + 1
        log = (Path(job.job_dir) / "output.log").read_text()
        assert "resume: continuing from" in log, log[-2000:]
        steps = _steps_logged(job.job_dir)
        assert [s for i, s in enumerate(steps) if i == 0 or s != steps[i - 1]] == list(
            range(1, STEPS + 1)), steps


def _sleepers(storage: str, tmp_path: Path, preemption: bool) -> tuple[JobService, Scheduler]:
    """A one-slot service whose only slot a priority-0 ``sleep`` holds."""
    slots = parse_slots("cpu:1")
    scheduler = Scheduler(JobStore(storage), slots, {"local": LocalBackend(slots)}, lease=5.0,
                          preemption=preemption)
    service = JobService(scheduler.store, scheduler, tmp_path / "jobs")
    service.submit({"name": "holder", "shell": True, "command": ["echo ready; exec sleep 60"],
                    "kill_grace": 5})
    log = Path(service.store.get("holder").job_dir) / "output.log"
    # Started for real (its wrapper passes signals on), not only claimed.
    wait_for(lambda: log.exists() and "ready" in log.read_text(), 30, "'holder' to run",
             scheduler.tick)
    return service, scheduler


def test_no_preemption_and_unpreemptible_jobs_keep_their_devices(
        storage: str, tmp_path: Path) -> None:
    service, scheduler = _sleepers(storage, tmp_path, preemption=False)
    service.submit({"name": "urgent", "command": ["true"], "priority": 5})
    scheduler.tick()
    assert [service.store.get(n).state for n in ("holder", "urgent")] == ["running", "queued"]
    service.cancel("holder")
    wait_for(lambda: service.store.get("holder").state == "cancelled", 30, "the cancel",
             scheduler.tick)

    service.submit({"name": "kept", "command": ["sleep", "60"], "preemptible": False})
    wait_for(lambda: service.store.get("kept").state == "running", 30, "'kept' to start",
             scheduler.tick)
    scheduler.preemption = True
    service.submit({"name": "urgent-2", "command": ["true"], "priority": 9})
    scheduler.tick()
    kept = service.store.get("kept")
    assert kept.state == "running" and not kept.preempting and not kept.as_dict()["preemptible"]
    service.cancel("kept")
    wait_for(lambda: service.store.get("urgent-2").state == "succeeded", 30, "'urgent-2'",
             scheduler.tick)


def test_a_preempted_command_waits_and_a_cancel_ends_it_at_once(
        storage: str, tmp_path: Path) -> None:
    service, scheduler = _sleepers(storage, tmp_path, preemption=True)
    service.submit({"name": "urgent", "command": ["sleep", "60"], "priority": 5})
    scheduler.tick()
    assert service.store.get("holder").as_dict()["preempting"]
    wait_for(lambda: service.store.get("holder").state == "preempted", 30, "the preemption",
             scheduler.tick)
    holder = service.store.get("holder")
    assert holder.reason == ("preempted for urgent (priority 5 > 0): exit 143; it resumes when "
                             "devices free up"), holder.reason
    assert holder.restarts == 0 and service.queue_positions() == {"holder": 1}
    assert service.cancel("holder").state == "cancelled"
    service.cancel("urgent")
    wait_for(lambda: service.store.get("urgent").state == "cancelled", 30, "the cancel",
             scheduler.tick)
