"""``--host`` and ``--port`` refused in one line; a port in use named."""

from __future__ import annotations

import socket

import pytest

from hybridtrain.server.errors import ServerError
from hybridtrain.server.listen import bind, check_host, check_port, is_loopback


def test_bad_ports_and_hosts_are_one_line() -> None:
    check_port(0)
    check_host("127.0.0.1")
    with pytest.raises(ServerError, match=r"--port 70000 is not a TCP port: give 0..65535"):
        check_port(70000)
    with pytest.raises(ServerError, match=r"--host '1.2.3' is not an IP address"):
        check_host("1.2.3")
    assert is_loopback("localhost") and is_loopback("::1") and not is_loopback("0.0.0.0")


def test_a_port_in_use_is_named() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ServerError, match=rf"127.0.0.1:{port} is in use"):
            bind("127.0.0.1", port).close()
    sock = bind("127.0.0.1", 0)
    assert sock.getsockname()[1] > 0
    sock.close()
