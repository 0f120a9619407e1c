"""Trial processes: own process group, stopped as a whole."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from hybridtrain.hpo.process import TrialProcess, process_start_ticks, stop_orphan_group

pytestmark = pytest.mark.timeout(60)

# A parent that starts a child ignoring SIGTERM, then sleeps: only SIGKILL of the whole
# group ends both.
STUBBORN = (f"{sys.executable} -c \"import signal,subprocess,sys,time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "p=subprocess.Popen([sys.executable,'-c','import signal,time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)']); "
            "print(p.pid, flush=True); time.sleep(60)\"")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose.
    return "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _start(tmp_path: Path, command: str) -> TrialProcess:
    return TrialProcess(command, tmp_path, dict(os.environ), tmp_path / "out.log",
                        tmp_path / "err.log").start()


def _child_pid(tmp_path: Path) -> int:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        text = (tmp_path / "out.log").read_text().strip()
        if text:
            return int(text)
        time.sleep(0.02)
    raise AssertionError("child never started")


def test_stop_kills_the_whole_group_after_grace(tmp_path: Path) -> None:
    proc = _start(tmp_path, STUBBORN)
    child = _child_pid(tmp_path)
    assert os.getpgid(child) == proc.pid
    t0 = time.monotonic()
    code = proc.stop(grace=0.5)
    assert code != 0
    assert 0.4 < time.monotonic() - t0 < 10
    time.sleep(0.1)
    assert not _alive(child)


def test_exit_code_and_stderr_tail(tmp_path: Path) -> None:
    proc = _start(tmp_path, "echo one >&2; echo two >&2; exit 3")
    while proc.poll() is None:
        time.sleep(0.01)
    assert proc.poll() == 3
    assert proc.stderr_tail() == "one | two"
    missing = _start(tmp_path, "no-such-command-xyz --flag")
    while missing.poll() is None:
        time.sleep(0.01)
    assert missing.poll() == 127
    assert "no-such-command-xyz" in missing.stderr_tail()


def test_orphan_group_is_stopped_only_if_it_is_ours(tmp_path: Path) -> None:
    proc = _start(tmp_path, STUBBORN)
    child = _child_pid(tmp_path)
    assert process_start_ticks(proc.pid) == proc.start_ticks
    # Wrong start time: a different process that reuses the pid is left alone.
    assert not stop_orphan_group(proc.pid, (proc.start_ticks or 0) + 1, grace=0.2)
    assert _alive(child)
    assert stop_orphan_group(proc.pid, proc.start_ticks, grace=0.2)
    proc.poll()
    time.sleep(0.1)
    assert not _alive(child)
