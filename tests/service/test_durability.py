"""``kill -9`` of a real ``hybridtrain serve`` mid-run loses nothing and runs nothing twice:
running jobs keep running and are adopted by the next service, queued jobs stay queued."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from hybridtrain.server.process_groups import group_alive
from hybridtrain.service.client import Client
from hybridtrain.service.transport import healthy
from tests.hpo.conftest import free_port
from tests.service.conftest import REPO, TOKEN, wait_for

pytestmark = pytest.mark.timeout(240)

# Counts to N in tenths of a second; writes one "start" line per process that runs it.
COUNTER = ("import json, os, sys, time; n = int(sys.argv[1]); "
           "print(json.dumps({'start': time.time(), 'pid': os.getpid()}), flush=True)\n"
           "for i in range(n): time.sleep(0.1)\n"
           "print(json.dumps({'end': time.time()}), flush=True)")


@contextmanager
def serve(tmp_path: Path, storage: str, tag: str) -> Iterator[tuple[subprocess.Popen[bytes], Client]]:
    """A real ``hybridtrain serve`` on a free port (2 CPU slots), stopped afterwards."""
    port = free_port()
    env = os.environ | {"HYBRIDTRAIN_HPO_TOKEN": TOKEN,
                        "HYBRIDTRAIN_SERVICE_DEVICES": "cpu:2",
                        "PYTHONPATH": str(REPO)}
    with (tmp_path / f"{tag}.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hybridtrain", "serve", "--port", str(port), "--storage",
             storage, "--jobs-dir", str(tmp_path / "jobs"), "--lease", "30"],
            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: proc.poll() is not None or healthy(base), 90, "the service to start")
        assert proc.poll() is None, (tmp_path / f"{tag}.log").read_text()
        yield proc, Client(base, TOKEN)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)


def test_kill9_of_the_service_loses_nothing_and_runs_nothing_twice(storage: str,
                                                                  tmp_path: Path) -> None:
    program = [sys.executable, "-S", "-c", COUNTER]
    with serve(tmp_path, storage, "first") as (proc, client):
        client.call("POST", "/v1/jobs", {"name": "long", "command": [*program, "40"]})
        client.call("POST", "/v1/jobs", {"name": "wide", "command": [*program, "5"],
                                         "devices": 2})
        client.call("POST", "/v1/jobs", {"name": "late", "command": [*program, "5"],
                                         "devices": 2, "priority": -1})
        # Claimed ("starting") comes before the process is recorded: wait for its pid.
        wait_for(lambda: client.call("GET", "/v1/jobs/long")["pid"] is not None, 30,
                 "'long' to run")
        long_job = client.call("GET", "/v1/jobs/long")
        # kill -9 while 'long' runs and the others wait for its device; a lease of 30 s
        # would hold the next service off, but it sees this one's process is gone.
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert group_alive(long_job["pid"]), "the running job died with its service"

    with serve(tmp_path, storage, "second") as (_, client):
        states = {j["name"]: j["state"] for j in client.call("GET", "/v1/jobs")}
        if states["long"] == "running":  # adopted, still holding its device
            assert states["wide"] == states["late"] == "queued", states
        wait_for(lambda: all(j["state"] not in ("queued", "running")
                             for j in client.call("GET", "/v1/jobs")), 60, "the jobs to end")
        jobs = {j["name"]: client.call("GET", f"/v1/jobs/{j['name']}")
                for j in client.call("GET", "/v1/jobs")}
        assert client.call("GET", "/v1/jobs/long/logs")["text"].count('"start"') == 1

    runs = {}
    for name, job in jobs.items():
        assert job["state"] == "succeeded", job
        assert job["attempt"] == 1 and len(job["history"]) == 1, job  # started exactly once
        lines = (Path(job["job_dir"]) / "output.log").read_text().splitlines()
        assert lines.count(f"--- attempt 1 on cpu {job['devices']} ---") == 1, lines
        records = [json.loads(ln) for ln in lines if ln.startswith("{")]
        assert len(records) == 2, lines  # one start, one end: one process ran it
        runs[name] = (records[0]["start"], records[1]["end"])
    assert jobs["long"]["pid"] is None and jobs["long"]["history"][0]["exit_code"] == 0
    # The adopted job kept its device until it ended: the two-device jobs came after it,
    # one after the other, in priority order.
    assert runs["long"][1] <= runs["wide"][0] and runs["wide"][1] <= runs["late"][0]
