"""Trial processes: own process group, stopped as a whole; a wait that ends at their exit."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from hybridtrain.hpo.process import TrialProcess, wait_for_exit
from hybridtrain.server.process_groups import process_start_ticks, stop_orphan_group

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


def _start(tmp_path: Path, command: str, argv: list[str] | None = None) -> TrialProcess:
    return TrialProcess(command, tmp_path, dict(os.environ), tmp_path / "out.log",
                        tmp_path / "err.log", argv).start()


def _exit_code(proc: TrialProcess) -> int:
    deadline = time.monotonic() + 30
    while (code := proc.poll()) is None and time.monotonic() < deadline:
        wait_for_exit([proc], timeout=1)
    assert code is not None, "did not exit"
    return code


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


def test_wait_ends_when_a_trial_exits_not_at_the_timeout(tmp_path: Path) -> None:
    short = _start(tmp_path, "sleep 0.3", ["sleep", "0.3"])
    long = _start(tmp_path, "sleep 60", ["sleep", "60"])
    assert short.exit_fd is not None, "no pidfd: the wait would fall back to polling"
    t0 = time.monotonic()
    wait_for_exit([long, short], timeout=30)
    assert time.monotonic() - t0 < 15
    assert short.poll() == 0 and short.exit_fd is None  # closed once the exit was seen
    # A write to the wake descriptor (the stop signal's) ends it as well.
    read_fd, write_fd = os.pipe()
    os.write(write_fd, b"!")
    t0 = time.monotonic()
    wait_for_exit([long], timeout=30, wake_fd=read_fd)
    assert time.monotonic() - t0 < 15 and long.poll() is None
    long.stop(grace=0.5)
    assert long.exit_fd is None
    os.close(read_fd)
    os.close(write_fd)


def test_direct_start_is_the_group_leader_and_a_plain_script_still_runs(tmp_path: Path) -> None:
    proc = _start(tmp_path, "", [sys.executable, "-S", "-c", "import os; print(os.getpgid(0))"])
    assert _exit_code(proc) == 0
    assert (tmp_path / "out.log").read_text().split() == [str(proc.pid)]
    # No "#!": the kernel refuses it, the shell runs it as a script, as it always did.
    script = tmp_path / "plain"
    script.write_text("echo loss=0.5\n")
    script.chmod(0o755)
    proc = _start(tmp_path, str(script), [str(script)])
    assert _exit_code(proc) == 0
    assert (tmp_path / "out.log").read_text().split()[-1] == "loss=0.5"
