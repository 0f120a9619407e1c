"""The way to the service (for :class:`~.client.Client` and the ``jobs`` commands): REST,
to a running one or to one started here.

The service to use is ``--server``/``$HYBRIDTRAIN_SERVER``, else the leader recorded in
the storage (every ``serve`` publishes its address with its lease). When none answers, an
*embedded* service is started in the background on the loopback port it had last time
(:func:`~.address.embedded_port`), on the same storage, token and jobs directory: it runs the
submitted jobs after the command returns, and any later ``jobs`` command (or ``hybridtrain
serve``) finds it through the storage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from hybridtrain.service import wrap
from hybridtrain.service.address import embedded_port
from hybridtrain.service.errors import JobError

SERVER_ENV = "HYBRIDTRAIN_SERVER"
#: Seconds to wait for an embedded service to take the lead.
START_TIMEOUT = 90.0


class Transport:
    """JSON over HTTP with the bearer token.

    Args:
        base: the service's address (``http://127.0.0.1:8080``).
        token: its bearer token.
    """

    def __init__(self, base: str, token: str) -> None:
        self.base, self.token = base.rstrip("/"), token

    def call(self, method: str, path: str, body: Any = None, timeout: float = 60.0) -> Any:
        """``method`` ``path`` with a JSON ``body``; the decoded answer.

        Raises:
            JobError: the service answered an error (its one-line ``detail``) or is unreachable.
        """
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base + path, data=data, method=method,
            headers={"Authorization": f"Bearer {self.token}",
                     "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            try:
                detail = json.loads(exc.read()).get("detail")
            except (ValueError, AttributeError):
                detail = None
            raise JobError(str(detail) if detail else f"{exc.code} {exc.reason}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise JobError(f"cannot reach the service at {self.base}: "
                           f"{getattr(exc, 'reason', exc)}") from None


def healthy(base: str) -> bool:
    """Whether ``base/health`` answers."""
    try:
        with urllib.request.urlopen(base.rstrip("/") + "/health", timeout=3):  # noqa: S310
            return True
    except OSError:
        return False


def connect(server: str | None = None, storage: str | None = None,
            token_file: Path | None = None, jobs_dir: Path | None = None,
            token: str | None = None, say: Any = None) -> Transport:
    """A client of the service (module docstring), starting an embedded one if needed.

    Raises:
        ServerError: bad token or storage; JobError: the embedded service did not start.
    """
    from hybridtrain.server.auth import resolve_token

    token = token or resolve_token(token_file)[0]
    base = server or os.environ.get(SERVER_ENV)
    if base:
        return Transport(base, token)
    from hybridtrain.service.store import JobStore

    store = JobStore(storage)
    _, url = store.leader()
    if url is None or not healthy(url):
        url = start_embedded(store, token_file, jobs_dir, say or (lambda _line: None))
    return Transport(url, token)


def start_embedded(store: Any, token_file: Path | None, jobs_dir: Path | None,
                   say: Any) -> str:
    """Start ``hybridtrain serve`` in the background; its address once it answers."""
    from hybridtrain.service.backend import DEFAULT_JOBS_DIR

    directory = (jobs_dir or DEFAULT_JOBS_DIR).resolve()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    port = embedded_port(directory)  # the one of last time: page addresses keep working
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "hybridtrain", "serve", "--port", str(port), "--storage",
            store.url, "--jobs-dir", str(directory)]
    if token_file is not None:
        argv += ["--token-file", str(token_file)]
    log_path = directory / "service.log"
    with open(log_path, "ab", opener=wrap.private) as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if healthy(url):
            say(f"started the service in the background (pid {proc.pid}, {url}, log "
                f"{log_path}); it runs the jobs after this command; `hybridtrain serve stop` stops it")
            return url
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or [""]
            raise JobError(f"the embedded service exited ({proc.returncode}): {tail[0]}")
        time.sleep(0.2)
    raise JobError(f"the embedded service did not start within {START_TIMEOUT:g} s; see "
                   f"{log_path}")
