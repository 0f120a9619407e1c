"""Where a service started in the background listens, and how to stop the one that leads.

An embedded service (started by a ``jobs`` command when none answers) listens on the port it
used last time, kept in ``JOBS_DIR/service.port``, so the page address a person bookmarked
keeps working; on the first start, or when another program has taken that port since, it
takes ``serve``'s default port when free, else any free loopback port, and remembers it.

``hybridtrain serve stop`` stops the service that leads a storage: SIGTERM to its process
(found through its lease, ``host:pid:random``), which finishes its round, gives the lease up
and exits. Running jobs go on: the next service adopts them, as after a crash.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

from hybridtrain.service.errors import JobError

#: ``serve``'s default port, also the first choice of an embedded service.
DEFAULT_PORT = 8080
#: File in the jobs directory holding the embedded service's port.
PORT_FILE = "service.port"


def _free(port: int) -> bool:
    with socket.socket() as probe:
        # As the server binds: connections of a stopped service waiting out TIME_WAIT do not
        # keep its port from the next one; a listening program does.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def embedded_port(jobs_dir: Path) -> int:
    """The port an embedded service for ``jobs_dir`` listens on (module docstring), recorded
    in ``jobs_dir/service.port``."""
    path = jobs_dir / PORT_FILE
    try:
        remembered = int(path.read_text().strip())
    except (OSError, ValueError):
        remembered = 0
    for port in (remembered, DEFAULT_PORT):
        if 0 < port < 65536 and _free(port):
            break
    else:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    tmp = path.with_name(f".{PORT_FILE}.{os.getpid()}")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)
    return port


def leader_pid(owner: str | None) -> int | None:
    """The pid of a lease owner (``host:pid:random``) when it runs on this host."""
    host, _, rest = (owner or "").partition(":")
    pid = rest.partition(":")[0]
    return int(pid) if host == socket.gethostname() and pid.isdigit() else None


def _is_service(pid: int) -> bool:
    """Whether ``pid`` is a hybridtrain service (not a process that got the pid since)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"serve" in argv and any(b"hybridtrain" in part for part in argv)


def stop_leader(owner: str | None, url: str | None, timeout: float = 30.0) -> str:
    """Stop the service holding the lease ``owner`` (at ``url``); a line saying what was done.

    Raises:
        JobError: no service leads, it runs on another host, or it did not exit in time.
    """
    if owner is None:
        return "no service leads this storage; nothing to stop"
    pid = leader_pid(owner)
    if pid is None:
        raise JobError(f"the service at {url or '?'} runs on host {owner.partition(':')[0]!r}; stop it there")
    if not _is_service(pid):
        return f"the service that led this storage (pid {pid}) has exited already"
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _is_service(pid):
            return (f"stopped the service at {url or '?'} (pid {pid}); running jobs go on and the next "
                    "service adopts them")
        time.sleep(0.1)
    raise JobError(f"the service (pid {pid}) did not exit within {timeout:g} s after SIGTERM; "
                   f"`kill -9 {pid}` ends it")
