"""Bearer-token authentication of ``hpo serve`` and ``serve`` (one token for both services).

Trial commands run on the server, so every request except ``/health`` and the OpenAPI
schema needs the token. It comes from ``$HYBRIDTRAIN_HPO_TOKEN``, else from a token file;
on first start a random token is generated into that file (mode 0600) and printed once.
A browser opens the dashboard once with ``?token=…``, which sets an HTTP-only cookie.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from hybridtrain.server.errors import ServerError

TOKEN_ENV = "HYBRIDTRAIN_HPO_TOKEN"
COOKIE = "hybridtrain_hpo_token"
DEFAULT_TOKEN_FILE = Path("~/.config/hybridtrain/hpo-token")
_MIN_LENGTH = 16

Scope = MutableMapping[str, Any]
#: ``(path, token) -> bool``: whether a token other than the server's own opens ``path``.
Admits = Callable[[str, str | None], bool]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
                   Awaitable[None]]


def resolve_token(token_file: Path | None = None) -> tuple[str, bool]:
    """The server's token: ``$HYBRIDTRAIN_HPO_TOKEN``, else the token file's content.

    Args:
        token_file: file holding the token (default ``~/.config/hybridtrain/hpo-token``);
            created with a new random token when missing.

    Returns:
        ``(token, created)``; ``created`` is true when the token was just generated.

    Raises:
        ServerError: the token is shorter than 16 characters, or the token file can be
            neither read nor created (one line).
    """
    token = os.environ.get(TOKEN_ENV, "").strip()
    created = False
    if not token:
        path = (token_file or DEFAULT_TOKEN_FILE).expanduser()
        try:
            if path.is_file():
                token = path.read_text().strip()
            else:
                token, created = _create_token_file(path)
        except (OSError, UnicodeDecodeError) as exc:
            why = getattr(exc, "strerror", None) or str(exc)
            raise ServerError(f"token file {str(path)[:200]!r}: {why}; give a readable file (or a "
                           f"path where one can be created) with --token-file, or set "
                           f"${TOKEN_ENV}") from None
    if len(token) < _MIN_LENGTH:
        raise ServerError(f"the HPO API token must have at least {_MIN_LENGTH} characters; got "
                       f"{len(token)} (from ${TOKEN_ENV} or the token file)")
    return token, created


def _create_token_file(path: Path) -> tuple[str, bool]:
    """Write a new random token to ``path`` (mode 0600), all or nothing.

    The token is written to a private temporary file and hard-linked into place, so a
    crash never leaves a half-written token file, and of two servers starting together
    one creates the file and the other reads it.
    """
    token = secrets.token_urlsafe(32)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)
    except FileExistsError:
        return path.read_text().strip(), False
    finally:
        tmp.unlink(missing_ok=True)
    return token, True


def token_matches(expected: str, given: str | None) -> bool:
    """Constant-time comparison, so response timing does not leak the token."""
    return given is not None and hmac.compare_digest(expected.encode(), given.encode())


def admitted(token: str, admits: Admits | None, path: str, given: str | None) -> bool:
    """Whether ``given`` opens ``path``: it is the server's ``token``, or ``admits`` lets it in."""
    return token_matches(token, given) or (admits is not None and given is not None and admits(path, given))


def bearer(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The bearer token of raw ASGI headers (``Authorization``) or the login cookie."""
    for key, value in headers:
        if key == b"authorization":
            scheme, _, cred = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                return cred.strip()
        if key == b"cookie":
            morsel = SimpleCookie(value.decode("latin-1")).get(COOKIE)
            if morsel is not None:
                return morsel.value
    return None


class TokenGuard:
    """ASGI wrapper that lets only requests with the token through to ``app``.

    ``?token=…`` on a request sets the login cookie and redirects to the same path
    without it, so the token does not stay in the browser's address bar.

    Args:
        app: the protected ASGI app (the dashboard).
        token: the expected token.
        admits: ``(path, token) -> bool``: whether another token (a user's) opens the path.
    """

    def __init__(self, app: ASGIApp, token: str, admits: Admits | None = None) -> None:
        self.app, self.token, self.admits = app, token, admits

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        path = request_path(scope)
        login = (query.get("token") or [None])[0]
        if admitted(self.token, self.admits, path, login):
            await respond(send, 303, b"", [(b"location", path.encode()), (
                b"set-cookie", f"{COOKIE}={login}; HttpOnly; SameSite=Strict; Path=/".encode())])
            return
        if admitted(self.token, self.admits, path, bearer(scope["headers"])):
            await self.app(scope, receive, send)
            return
        await respond(send, 401, b'{"detail":"missing or invalid bearer token"}',
                       [(b"content-type", b"application/json"),
                        (b"www-authenticate", b"Bearer")])


def request_path(scope: Scope) -> str:
    """The path the client asked for, inside a mount or not: Starlette keeps the full path
    in ``path`` (and the mount's prefix in ``root_path``); other servers strip the prefix."""
    root, path = scope.get("root_path", ""), scope["path"]
    return path if path.startswith(root) else root + path


async def respond(send: Callable[[Any], Awaitable[None]], status: int, body: bytes,
                  headers: list[tuple[bytes, bytes]]) -> None:
    """Send a complete HTTP response from ASGI middleware."""
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
