"""``hybridtrain jobs …`` with no service running: the first command starts one in the
background, and submit, wait, logs, list, show, cancel and resubmit all go through it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hybridtrain.commands.cli import build_parser, main
from hybridtrain.commands.jobs import submit_args
from tests.service.conftest import REPO, TOKEN

pytestmark = pytest.mark.timeout(180)


class Result:
    """What one in-process ``hybridtrain jobs`` command did."""

    def __init__(self, code: int, out: str, err: str) -> None:
        self.returncode, self.stdout, self.stderr = code, out, err

    def __repr__(self) -> str:
        return f"exit {self.returncode}\n{self.stdout}\n{self.stderr}"


@pytest.fixture
def jobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
         capsys: pytest.CaptureFixture[str]) -> Callable[..., Result]:
    """Run ``hybridtrain jobs ARGS`` in this process (the service it starts is a real one)."""
    monkeypatch.setenv("HYBRIDTRAIN_HPO_TOKEN", TOKEN)
    monkeypatch.setenv("HYBRIDTRAIN_SERVICE_DEVICES", "cpu:2")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.delenv("HYBRIDTRAIN_SERVER", raising=False)
    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> Result:
        # Our options before the job's program, which takes everything after "--".
        code = main(["jobs", args[0], "--storage", f"sqlite:///{tmp_path / 's.db'}",
                     *args[1:]])
        out = capsys.readouterr()
        return Result(code, out.out, out.err)

    return run


def test_jobs_commands_start_an_embedded_service(tmp_path: Path, jobs: Callable[..., Result],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "count.py"
    script.write_text("import sys, time\nfor i in range(int(sys.argv[1])):\n"
                      "    print('tick', i, flush=True); time.sleep(0.1)\n")
    first = jobs("submit", "--name", "count", "--", sys.executable, "-S",
                  str(script), "3")
    assert first.returncode == 0, first.stderr
    started = re.search(r"started the service in the background \(pid (\d+)", first.stderr)
    assert started, first.stderr
    pid = int(started.group(1))
    try:
        assert "submitted count" in first.stdout
        waited = jobs("wait", "count", "--timeout", "60")
        assert waited.returncode == 0 and "succeeded" in waited.stdout, waited
        logs = jobs("logs", "count")
        assert [ln for ln in logs.stdout.splitlines() if ln.startswith("tick")] == [
            "tick 0", "tick 1", "tick 2"]
        # A second job, cancelled while it runs (SIGTERM), and the JSON forms.
        assert jobs("submit", "--name", "long", "--", sys.executable, "-S",
                     str(script), "600").returncode == 0
        # Cancel once it runs (a cancel while queued would not reach a process).
        while "tick 0" not in jobs("logs", "long").stdout:
            time.sleep(0.2)
        cancel = jobs("cancel", "long", "--wait")
        assert cancel.returncode == 130, cancel
        listed = json.loads(jobs("list", "--json").stdout)
        assert {j["name"]: j["state"] for j in listed} == {"count": "succeeded",
                                                            "long": "cancelled"}
        shown = json.loads(jobs("show", "long", "--json").stdout)
        assert shown["reason"] == "cancelled on request: exit 143"  # python: no handler
        assert jobs("resubmit", "count").returncode == 0
        assert jobs("wait", "count", "--timeout", "60").returncode == 0
        bad = jobs("submit", "--devices", "9", "--", "true")
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1
        assert "devices = 9: this machine has 2 cpu slots" in bad.stderr
        missing = jobs("submit", "nope.yaml")
        assert missing.returncode == 2 and "config 'nope.yaml' not found" in missing.stderr
        # `serve stop` stops it; the next command starts one at the same address.
        url = re.search(r"(http://127\.0\.0\.1:\d+)", first.stderr).group(1)  # type: ignore[union-attr]
        storage = ["--storage", f"sqlite:///{tmp_path / 's.db'}"]
        assert main(["serve", "stop", *storage]) == 0
        assert f"stopped the service at {url} (pid {pid})" in capsys.readouterr().out
        again = jobs("list")
        assert "started the service in the background" in again.stderr and url in again.stderr, again
        pid = int(re.search(r"\(pid (\d+)", again.stderr).group(1))  # type: ignore[union-attr]
        assert main(["serve", "stop", *storage]) == 0 and "stopped" in capsys.readouterr().out
        assert main(["serve", "stop", *storage]) == 0
        assert "nothing to stop" in capsys.readouterr().out
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def test_preemption_options_reach_the_spec_and_the_scheduler() -> None:
    parser = build_parser()
    args = parser.parse_args(["jobs", "submit", "--not-preemptible", "--", "sleep", "1"])
    assert submit_args(args)[1]["preemptible"] is False
    assert submit_args(parser.parse_args(["jobs", "submit", "--", "true"]))[1]["preemptible"]
    assert parser.parse_args(["serve", "--no-preemption"]).preemption is False
    assert parser.parse_args(["serve"]).preemption is True
