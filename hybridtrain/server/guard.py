"""ASGI guard in front of the REST API: token first, then a bounded body.

FastAPI reads and parses a request body before it runs a route's dependencies, so a
token check written as a dependency comes too late: an unauthenticated client could make
the server buffer and parse hundreds of megabytes. :class:`ApiGuard` runs before FastAPI
sees the request. It answers 401 to a ``/v1`` request without a valid token from the
headers alone, and 413 to any body over the limit, whether announced by
``Content-Length`` or streamed in chunks (it stops reading at the limit).

``/metrics`` is read-only and bodyless: a request other than ``GET``/``HEAD`` is answered
405 from the headers, so not a byte of any body sent there is read. It needs the token
like ``/v1`` unless the server was started with ``--metrics-public``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from hybridtrain.server.auth import Admits, ASGIApp, Scope, admitted, bearer, respond

#: Default body limit: an experiment spec is a few kilobytes.
DEFAULT_MAX_BODY = 1024 * 1024
#: Prometheus text of a service (:mod:`hybridtrain.hpo.exporter`, :mod:`hybridtrain.service.exporter`).
METRICS_PATH = "/metrics"

Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]


class ApiGuard:
    """Authenticate ``/v1`` (and ``/metrics``) requests and bound every request body.

    Args:
        app: the wrapped ASGI app.
        token: the bearer token ``/v1`` requests must carry.
        max_body: largest accepted body in bytes.
        metrics_public: serve ``/metrics`` without the token.
        admits: ``(path, token) -> bool``: whether another token (a user's) opens that path.
    """

    def __init__(self, app: ASGIApp, token: str, max_body: int = DEFAULT_MAX_BODY,
                 metrics_public: bool = False, admits: Admits | None = None) -> None:
        self.app, self.token, self.max_body = app, token, max_body
        self.metrics_public = metrics_public
        self.admits = admits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        metrics = path == METRICS_PATH
        protected = path == "/v1" or path.startswith("/v1/") or (
            metrics and not self.metrics_public)
        if protected and not admitted(self.token, self.admits, path, bearer(scope["headers"])):
            await _reply(send, 401, "missing or invalid bearer token",
                         [(b"www-authenticate", b"Bearer")])
            return
        if metrics and scope["method"] not in ("GET", "HEAD"):
            await _reply(send, 405, "method not allowed: /metrics is read-only (GET)",
                         [(b"allow", b"GET, HEAD"), (b"connection", b"close")])
            return
        declared = _content_length(scope["headers"])
        if declared is not None and declared > self.max_body:
            await self._too_large(send, declared)
            return
        body = bytearray()
        more = scope["method"] not in ("GET", "HEAD", "OPTIONS", "DELETE")
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_body:
                await self._too_large(send, None)
                return
            more = message.get("more_body", False)
        await self.app(scope, _replay(bytes(body), receive), send)

    async def _too_large(self, send: Send, declared: int | None) -> None:
        got = f"{declared} bytes" if declared is not None else "more than that"
        await _reply(send, 413, f"request body too large: at most {self.max_body} bytes "
                                f"are accepted; got {got}", [(b"connection", b"close")])


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for key, value in headers:
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the body already read, then waits as before."""
    sent = False

    async def replay() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # e.g. http.disconnect while streaming a response

    return replay


async def _reply(send: Send, status: int, detail: str,
                 headers: list[tuple[bytes, bytes]]) -> None:
    await respond(send, status, json.dumps({"detail": detail}).encode(),
                  [(b"content-type", b"application/json"), *headers])
