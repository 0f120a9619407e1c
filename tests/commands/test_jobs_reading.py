"""Reading the queue from the ``jobs`` commands: ``list`` with a header, priority and age,
the queue in start order; no traceback into a closed pipe; ``wait`` says what a queued
job waits for."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridtrain.commands.cli import main
from hybridtrain.service.client import Client
from tests.service.conftest import REPO, TOKEN, wait_for

pytestmark = pytest.mark.timeout(240)  # above the service waits (30 s x SLACK) and the start


@pytest.fixture
def queue(served: dict[str, str], tmp_path: Path) -> Iterator[str]:
    """One job holding the only slot, two queued behind it (the later one more urgent)."""
    client = Client(served["base"], TOKEN)
    for name, priority in (("holder", 0), ("early-low", 0), ("late-high", 5)):
        # The holder is not preemptible: the urgent job waits behind it.
        client.call("POST", "/v1/jobs", {"name": name, "priority": priority,
                                         "preemptible": name != "holder",
                                         "workdir": str(tmp_path), "command": ["sleep", "60"]})
        while name == "holder" and client.call("GET", "/v1/jobs/holder")["state"] != "running":
            time.sleep(0.1)
    yield served["base"]
    client.call("POST", "/v1/jobs/holder/cancel")  # a stopped service leaves jobs running
    wait_for(lambda: client.call("GET", "/v1/jobs/holder")["state"] == "cancelled", 30,
             "the holder to stop")


def test_list_has_a_header_and_the_queue_in_start_order(
        queue: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDTRAIN_HPO_TOKEN", TOKEN)
    assert main(["jobs", "list", "--server", queue]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "STATE", "PRIORITY", "DEVICES", "AGE", "RESTARTS", "REASON"]
    rows = [line.split() for line in lines[1:]]
    assert [r[0] for r in rows] == ["holder", "late-high", "early-low"]
    assert rows[1][1:4] == ["queued", "#1", "5"] and rows[2][1:4] == ["queued", "#2", "0"]
    assert rows[0][1:4] == ["running", "0", "0"] and rows[0][4].endswith("s")


def test_a_closed_pipe_ends_the_listing_without_a_traceback(queue: str) -> None:
    env = os.environ | {"HYBRIDTRAIN_HPO_TOKEN": TOKEN, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "hybridtrain", "jobs", "list",
                             "--server", queue], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before a byte is written (`| head -0`)
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 141 and err == "", err


def test_wait_says_what_a_queued_job_waits_for(
        queue: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDTRAIN_HPO_TOKEN", TOKEN)
    assert main(["jobs", "wait", "early-low", "--timeout", "1", "--server", queue]) == 124
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "info: early-low queued: position 2, waiting for 1 devices"
    assert err.count("queued: position") == 1  # said once, not at every poll
