"""``hybridtrain hpo serve``: the REST API and the dashboard in one uvicorn server."""

from __future__ import annotations

import errno
import ipaddress
import socket
import sys
from pathlib import Path

from hybridtrain.hpo.auth import TOKEN_ENV, resolve_token
from hybridtrain.hpo.errors import HPOError


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_port(port: int) -> None:
    """Refuse a port TCP does not have (one line)."""
    if not 0 <= port <= 65535:
        raise HPOError(f"--port {port} is not a TCP port: give 0..65535 (0 = any free port)")


def check_host(host: str) -> None:
    """Refuse a bind address that is neither an IP address nor a name that resolves."""
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    if not host or host.replace(".", "").isdigit():
        raise HPOError(f"--host {host!r} is not an IP address (e.g. 127.0.0.1, 0.0.0.0, ::1)")
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise HPOError(f"--host {host!r} does not resolve ({exc}); give an address of this "
                       "machine (127.0.0.1, 0.0.0.0)") from None


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``; a port in use or an address not of this machine
    is one line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        why = {errno.EADDRINUSE: "is in use (another service?); choose another --port, or 0 "
                                 "for any free one",
               errno.EADDRNOTAVAIL: "is not an address of this machine; give one of its "
                                    "addresses (127.0.0.1, 0.0.0.0)",
               errno.EACCES: "needs privileges (ports below 1024); choose a port from 1024"
               }.get(exc.errno or 0, f"cannot be bound: {exc.strerror}")
        raise HPOError(f"{host}:{port} {why}") from None
    return sock


def serve(host: str = "127.0.0.1", port: int = 8080, storage: str | None = None,
          token_file: Path | None = None, metrics_public: bool = False) -> int:
    """Serve until interrupted.

    Args:
        host: bind address; loopback unless told otherwise.
        port: TCP port.
        storage: storage URL of the experiments.
        token_file: where the bearer token lives (see :mod:`hybridtrain.hpo.auth`).
        metrics_public: serve ``/metrics`` without the token.

    Returns:
        The exit code (0).

    Raises:
        HPOError: bad token, storage or port.
    """
    import uvicorn

    from hybridtrain.hpo.api import create_app
    from hybridtrain.hpo.slow_clients import guarded_protocol

    check_port(port)
    check_host(host)
    from hybridtrain.hpo.experiments import ExperimentStore

    token, created = resolve_token(token_file)
    store = ExperimentStore(storage)
    app = create_app(store, token, metrics_public=metrics_public)
    if created:
        print(f"generated API token (saved; set ${TOKEN_ENV} to override): {token}", flush=True)
    if not _is_loopback(host):
        print(f"warning: binding {host}: trial commands run on this machine; anyone who "
              "has the token can start them", file=sys.stderr)
    base = f"http://{host}:{port}"
    print(f"REST API:  {base}/v1/experiments  (schema: {base}/openapi.json)\n"
          f"dashboard: {base}/dashboard?token=<token>\n"
          f"metrics:   {base}/metrics  "
          f"({'no token needed' if metrics_public else 'bearer token needed'})", flush=True)
    # Slow or greedy clients are cut off (hybridtrain.hpo.slow_clients): no unauthenticated
    # client can hold the server's connections.
    uvicorn.run(app, host=host, port=port, log_level="warning", http=guarded_protocol())
    return 0
