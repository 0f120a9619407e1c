"""Honest statuses: a job whose training had finished when its cancel arrived is
``succeeded``, even when the SIGTERM then cut its exit short (exit 143)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hybridtrain.service.api import JobService
from hybridtrain.service.devices import parse_slots
from hybridtrain.service.opening import make_backends, open_service
from tests.service.conftest import wait_for

pytestmark = pytest.mark.timeout(120)

# Writes its summary as `hybridtrain train` does at the end (or an interrupted one), says
# so, then lingers without a SIGTERM handler, as a trainer tearing down does.
PROGRAM = ("import json, os, pathlib, sys, time\n"
           "run = pathlib.Path(os.environ['HYBRIDTRAIN_JOB_DIR'], 'run'); run.mkdir()\n"
           "(run / 'summary.json').write_text(json.dumps({'interrupted': sys.argv[1] == 'yes'}))\n"
           "print('summary written', flush=True); time.sleep(60)\n")


@pytest.fixture
def service(storage: str, tmp_path: Path) -> JobService:
    slots = parse_slots("cpu:2")
    return open_service(storage, tmp_path / "jobs", None, make_backends(slots), slots)


def _cancel_after_summary(service: JobService, tmp_path: Path, name: str, interrupted: str
                          ) -> str:
    service.submit({"name": name, "workdir": str(tmp_path),
                    "command": [sys.executable, "-S", "-c", PROGRAM, interrupted]})
    wait_for(lambda: "summary written" in service.logs(name)["text"], 30, "the summary",
             service.scheduler.tick)
    service.cancel(name)
    wait_for(lambda: service.store.get(name).state not in ("queued", "running"), 30,
             "the job to end", service.scheduler.tick)
    return service.store.get(name).state


def test_a_job_that_finished_training_before_the_cancel_succeeded(
        service: JobService, tmp_path: Path) -> None:
    assert _cancel_after_summary(service, tmp_path, "done", "no") == "succeeded"
    job = service.store.get("done")
    assert job.exit_code == 143 and "finished before the cancel reached it" in job.reason


def test_an_interrupted_job_is_cancelled(service: JobService, tmp_path: Path) -> None:
    assert _cancel_after_summary(service, tmp_path, "cut", "yes") == "cancelled"
