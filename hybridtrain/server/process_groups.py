"""Process groups: whether one is alive, stopping one, and stopping one an owner left behind.

A trial (:mod:`hybridtrain.hpo.process`) or a local job (:mod:`hybridtrain.service.local`)
runs in a session of its own, so it and everything it starts share one process group that
is signalled as a whole. A group is named by its leader's pid together with the leader's
start time (:func:`process_start_ticks`), so a reused pid is never taken for it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


def process_start_ticks(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux ``/proc``).

    Together with the pid it identifies a process across pid reuse.

    Returns:
        The start time, or ``None`` if the process does not exist or ``/proc`` is absent.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 2 (comm) may contain spaces and parentheses; fields after the last ")" are fixed.
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[19])


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a member left (one we may not signal counts)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to process group ``pgid``; a group that is gone (or not ours) is no error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_group(pgid: int, grace: float, leader: subprocess.Popen[bytes] | None = None) -> None:
    """SIGTERM the process group ``pgid``; SIGKILL whatever is left after ``grace`` seconds.

    Args:
        pgid: the process group id.
        grace: seconds to wait for a clean exit.
        leader: the group leader when it is our child, so it is reaped (a zombie leader
            would keep the group "alive").
    """
    signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if leader is not None:
            leader.poll()
        if not group_alive(pgid):
            return
        time.sleep(0.02)
    signal_group(pgid, signal.SIGKILL)
    if leader is not None:
        leader.wait()


def stop_orphan_group(pgid: int, start_ticks: int | None, grace: float) -> bool:
    """Stop a process group (a trial's, a job's) left behind by a process that died.

    The group is signalled only if its leader is gone (a live group id cannot be reused)
    or is still the very process that was started (same start time), never a stranger
    that happens to have the same pid.

    Returns:
        Whether a live group was found and stopped.
    """
    ticks = process_start_ticks(pgid)
    if ticks is not None and ticks != start_ticks:
        return False
    if not group_alive(pgid):
        return False
    stop_group(pgid, grace)
    return True
