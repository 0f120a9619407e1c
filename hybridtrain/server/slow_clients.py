"""Slow and greedy clients cannot starve ``hpo serve`` (slowloris).

uvicorn closes idle keep-alive connections, but waits for a request's headers and body
for as long as a client keeps trickling bytes: 100 connections that each send a header
byte now and then, without any token, would hold 100 file descriptors forever and the
server would stop answering, ``/health`` included. :class:`GuardedH11Protocol` is
uvicorn's h11 protocol with two bounds added:

- a request (headers and body) must arrive within ``request_timeout`` seconds of its
  first byte (of the connection, for the first request): otherwise the connection is
  closed. A silent new connection gets the same time.
- one client address holds at most ``per_client`` connections still waiting for their
  request: opening one more closes its oldest waiting one, so a greedy client evicts
  itself, and a fresh connection (a health check, another user behind the same NAT)
  is always served.

Connections whose request is complete (the app is answering it) are never cut.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

REQUEST_TIMEOUT_S = 10.0
PER_CLIENT = 32


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the bounds of the module docstring.

    Set the bounds per server with :func:`guarded_protocol` (class attributes).
    """

    request_timeout: ClassVar[float] = REQUEST_TIMEOUT_S
    per_client: ClassVar[int] = PER_CLIENT
    # Per client address: its connections waiting for a request, oldest first.
    _waiting: ClassVar[dict[str, OrderedDict[GuardedH11Protocol, None]]]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        self._peer = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        self._deadline: asyncio.TimerHandle | None = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the next request of a keep-alive connection starts its own clock
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE and self.conn.their_state is not h11.SEND_BODY:
            self._disarm()  # the whole request is in (or the connection is over)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._deadline = self.loop.call_later(self.request_timeout, self._too_slow)
        waiting = self._waiting.setdefault(self._peer, OrderedDict())
        waiting[self] = None
        while len(waiting) > self.per_client:
            oldest = next(iter(waiting))
            oldest._too_slow()

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        waiting = self._waiting.get(self._peer)
        if waiting is not None:
            waiting.pop(self, None)
            if not waiting:
                self._waiting.pop(self._peer, None)

    def _too_slow(self) -> None:
        self._disarm()
        self.transport.close()


def guarded_protocol(request_timeout: float = REQUEST_TIMEOUT_S, per_client: int = PER_CLIENT) -> type[H11Protocol]:
    """A :class:`GuardedH11Protocol` class with these bounds and its own bookkeeping,
    for ``uvicorn.Config(http=...)``."""
    attrs: dict[str, Any] = {"request_timeout": request_timeout, "per_client": per_client, "_waiting": {}}
    return type("GuardedH11Protocol", (GuardedH11Protocol,), attrs)
