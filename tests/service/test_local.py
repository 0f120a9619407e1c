"""Jobs on this machine, with real trainer processes and the real storage: several jobs
queue and run as their devices allow (gang), one is cancelled and leaves a checkpoint, one
loses its process (SIGKILL) and restarts from its newest checkpoint."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from hybridtrain.service.api import JobService
from hybridtrain.service.devices import parse_slots
from hybridtrain.service.errors import JobConflictError, JobSpecError
from hybridtrain.service.local import LocalBackend
from hybridtrain.service.scheduler import Scheduler
from hybridtrain.service.store import JobStore
from tests.service.conftest import kill_members, tiny_config, wait_for

pytestmark = pytest.mark.timeout(240)

# Records when it ran and on which cores, so the test can check that the gang held.
PROBE = ("import json, os, sys, time; t0 = time.time(); time.sleep(float(sys.argv[1])); "
         "print(json.dumps({'start': t0, 'end': time.time(), "
         "'cores': sorted(os.sched_getaffinity(0))}))")


def _service(storage: str, tmp_path: Path) -> JobService:
    slots = parse_slots("cpu:2")
    scheduler = Scheduler(JobStore(storage), slots, {"local": LocalBackend(slots)}, lease=5.0)
    return JobService(scheduler.store, scheduler, tmp_path / "jobs")


def _probe(job_dir: str) -> dict[str, float]:
    lines = [ln for ln in (Path(job_dir) / "output.log").read_text().splitlines()
             if ln.startswith("{")]
    assert len(lines) == 1, lines
    return dict(json.loads(lines[0]))


def test_jobs_queue_by_devices_cancel_leaves_checkpoint_and_a_killed_run_resumes(
        storage: str, tmp_path: Path) -> None:
    service = _service(storage, tmp_path)
    store, tick = service.store, service.scheduler.tick
    crash_cfg = tiny_config(tmp_path / "crash.yaml", steps=12, checkpoint_every=4)
    cancel_cfg = tiny_config(tmp_path / "cancel.yaml", steps=400, checkpoint_every=3)
    py = [sys.executable, "-S", "-c", PROBE]
    service.submit({"name": "crash", "config": str(crash_cfg), "max_restarts": 2})
    service.submit({"name": "cancel", "config": str(cancel_cfg), "kill_grace": 60})
    service.submit({"name": "big", "command": [*py, "0.5"], "devices": 2})
    service.submit({"name": "small", "command": [*py, "0.2"], "devices": 1})
    # Bad input is refused before anything is stored.
    with pytest.raises(JobSpecError, match="devices = 3: this machine has 2 cpu slots"):
        service.submit({"name": "huge", "command": ["true"], "devices": 3})
    with pytest.raises(JobSpecError, match="name"):
        service.submit({"name": "../escape", "command": ["true"]})
    with pytest.raises(JobConflictError):
        service.submit({"name": "small", "command": ["true"]})
    tick()
    running = {j.name: j.devices for j in store.jobs(("running",))}
    assert running == {"crash": (0,), "cancel": (1,)}  # first come, first served; gang waits

    run_dir = Path(store.get("crash").job_dir) / "run"
    wait_for(lambda: any((run_dir / "checkpoints").glob("step-*")), 120,
             "the first checkpoint of 'crash'", tick)
    kill_members(store.get("crash").pgid or 0)  # a rank dies under its launcher
    cancel_dir = Path(store.get("cancel").job_dir) / "run"
    wait_for(lambda: any((cancel_dir / "checkpoints").glob("step-*")), 120,
             "a checkpoint of 'cancel'", tick)
    service.cancel("cancel")
    wait_for(lambda: all(j.state not in ("queued", "running") for j in store.jobs()), 180,
             "every job to end", tick)

    jobs = {j.name: j for j in store.jobs()}
    assert {n: j.state for n, j in jobs.items()} == {
        "crash": "succeeded", "cancel": "cancelled", "big": "succeeded", "small": "succeeded"}
    crash = jobs["crash"]
    assert crash.restarts == 1 and crash.attempt == 2
    assert crash.history[0]["reason"].startswith("restart 1/2 (it resumes from its newest "
                                                 "checkpoint) after: killed by SIGKILL")
    log = (Path(crash.job_dir) / "output.log").read_text()
    resumed = re.search(r"resume: continuing from \S+ at step (\d+)", log)
    assert resumed, log[-2000:]
    assert int(resumed.group(1)) >= 4
    # The metrics read as one uninterrupted run: steps past the checkpoint that the killed
    # attempt had logged were dropped on resume and trained once more (a step's extra
    # records, e.g. at a checkpoint, repeat its number).
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]
    assert [s for i, s in enumerate(steps) if i == 0 or s != steps[i - 1]] == list(range(1, 13))

    cancel = jobs["cancel"]
    assert cancel.exit_code == 130
    assert "saved a checkpoint and stopped" in cancel.reason
    saved = sorted((cancel_dir / "checkpoints").glob("step-*"))
    assert saved and int(saved[-1].name.split("-")[1]) < 400

    # The gang held: 'big' had both cores and ran alone; nothing ran on a busy core.
    big, small = _probe(jobs["big"].job_dir), _probe(jobs["small"].job_dir)
    assert big["cores"] == [0, 1] and len(small["cores"]) == 1
    for other in ("crash", "cancel"):
        assert jobs[other].finished_at is not None and jobs[other].started_at is not None
        overlap = (min(big["end"], jobs[other].finished_at)
                   - max(big["start"], jobs[other].started_at))
        assert overlap <= 0, other
    assert small["end"] <= big["start"] or small["start"] >= big["end"]

    # A finished job can be queued again; a running one cannot.
    assert service.resubmit("small").state == "queued"
    with pytest.raises(JobConflictError, match="only a finished job"):
        service.resubmit("small")
