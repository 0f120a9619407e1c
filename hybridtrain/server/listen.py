"""Where a service listens: its ``--host`` and ``--port`` checked, its socket bound.

Both ``hpo serve`` and ``serve`` refuse a bad address in one line before anything starts.
"""

from __future__ import annotations

import errno
import ipaddress
import socket

from hybridtrain.server.errors import ServerError


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine's loopback (only local users reach the server)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_port(port: int) -> None:
    """Refuse a port TCP does not have (one line)."""
    if not 0 <= port <= 65535:
        raise ServerError(f"--port {port} is not a TCP port: give 0..65535 (0 = any free port)")


def check_host(host: str) -> None:
    """Refuse a bind address that is neither an IP address nor a name that resolves."""
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    if not host or host.replace(".", "").isdigit():
        raise ServerError(f"--host {host!r} is not an IP address (e.g. 127.0.0.1, 0.0.0.0, ::1)")
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ServerError(f"--host {host!r} does not resolve ({exc}); give an address of this "
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
        raise ServerError(f"{host}:{port} {why}") from None
    return sock
