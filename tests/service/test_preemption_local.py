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
