"""The errors both services share: one neutral base and the kinds their REST app answers.

The HPO service (:mod:`hybridtrain.hpo.errors`) and the training service
(:mod:`hybridtrain.service.errors`) derive their own classes from these, so neither part
needs the other's errors, while one REST app maps every kind to one status code
(:func:`error_status`) and the command line prints every one as one line.
"""

from __future__ import annotations

import errno


class ServerError(Exception):
    """Base class of every error a user of either service can cause; the message is one line."""


class InvalidRequestError(ServerError, ValueError):
    """A spec or request failed validation (raised before any work starts): 422."""


class ConflictError(InvalidRequestError):
    """The request conflicts with what is stored (a name in use, a different spec): 409."""


class StorageError(ServerError):
    """The storage cannot be opened or does not hold what was asked for: 503."""


class StorageFullError(StorageError):
    """The disk (or quota) under the storage or a job's files is full; nothing was written: 507."""


class NotFoundError(StorageError):
    """No stored object of the given name: 404."""


#: ``errno`` values of a full disk or an exhausted quota.
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)

#: Most specific first: a not-found is a storage error, a conflict an invalid request.
_STATUS = ((NotFoundError, 404), (ConflictError, 409), (InvalidRequestError, 422),
           (StorageFullError, 507), (StorageError, 503))


def error_status(exc: ServerError) -> int:
    """The HTTP status a REST app answers ``exc`` with (409 for a kind not listed)."""
    return next((code for cls, code in _STATUS if isinstance(exc, cls)), 409)


def first_line(exc: BaseException) -> str:
    """The first line of a (database) error's message, for one-line errors."""
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def storage_error(exc: BaseException) -> StorageError:
    """A database or file error met while serving a request, as one line: full (507) when
    the disk or quota is full, else unavailable (503)."""
    line = first_line(exc)
    if getattr(exc, "errno", None) in _FULL_ERRNOS or "full" in line.lower():
        return StorageFullError(f"storage is full, nothing was written: {line}; free space "
                                "under the storage and the jobs directory")
    return StorageError(f"storage unavailable: {line}")
