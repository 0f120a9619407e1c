"""What both services' REST apps share: the token dependency and one-line error answers.

Errors are JSON ``{"detail": "one line"}``: a :class:`~hybridtrain.server.errors.ServerError`
with the status of its kind (:func:`~hybridtrain.server.errors.error_status`), 422 for a
request FastAPI cannot validate, 503 (507 when full) for a database or file error met while
answering.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

import sqlalchemy
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from hybridtrain.server.auth import token_matches
from hybridtrain.server.errors import ServerError, StorageError, StorageFullError, error_status, storage_error

_SCHEME = HTTPBearer(auto_error=False)


def require_token(
    request: Request, cred: Annotated[HTTPAuthorizationCredentials | None, Depends(_SCHEME)]
) -> None:
    """Dependency of every ``/v1`` route: the app's bearer token must be presented.

    :class:`~hybridtrain.server.guard.ApiGuard` has refused a request without it already,
    before the body was read; this dependency puts the scheme into the OpenAPI schema
    and keeps a route safe should it ever be served without the guard.

    Raises:
        HTTPException: 401 with ``WWW-Authenticate: Bearer``.
    """
    if cred is None or not token_matches(request.app.state.token, cred.credentials):
        raise HTTPException(401, "missing or invalid bearer token",
                            headers={"WWW-Authenticate": "Bearer"})


def validation_line(errors: Sequence[Any]) -> str:
    """FastAPI's request-validation errors as one line: where, and what is allowed (the
    input itself is left out: it may be huge, or a number JSON cannot hold)."""
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ())) or "request"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {first.get('msg', 'invalid')}{more}"


def _storage_answer(exc: StorageError) -> JSONResponse:
    return JSONResponse({"detail": str(exc)},
                        status_code=507 if isinstance(exc, StorageFullError) else 503)


def answer_errors_in_one_line(app: FastAPI) -> None:
    """Install the error answers of the module docstring on ``app``."""

    @app.exception_handler(ServerError)
    async def _server_error(_request: Request, exc: ServerError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=error_status(exc))

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own answer echoes the input, which fails to encode when it is a float
        # no JSON holds (a body of ``1e999``) and turns a 422 into a 500: one line instead.
        return JSONResponse({"detail": validation_line(exc.errors())}, status_code=422)

    @app.exception_handler(sqlalchemy.exc.OperationalError)
    async def _database_error(_request: Request, exc: sqlalchemy.exc.OperationalError
                              ) -> JSONResponse:
        return _storage_answer(storage_error(exc))

    @app.exception_handler(OSError)
    async def _file_error(_request: Request, exc: OSError) -> JSONResponse:
        return _storage_answer(storage_error(exc))
