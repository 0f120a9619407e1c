"""Exceptions of the HPO service.

Every error a user can cause carries a one-line message that names the field or the
resource, the offending value and what is allowed, so the CLI can print it as is.
"""

from __future__ import annotations

import errno


class HPOError(Exception):
    """Base class of every error raised by :mod:`hybridtrain.hpo`."""


class SpecError(HPOError, ValueError):
    """An experiment spec failed validation (raised before any work starts)."""


class ExperimentConflictError(SpecError):
    """An experiment of that name is stored with a different search definition."""


class StorageError(HPOError):
    """The experiment storage cannot be opened or does not hold what was asked for."""


class StorageFullError(StorageError):
    """The disk (or quota) under the storage or a job's files is full; nothing was written."""


#: ``errno`` values of a full disk or an exhausted quota.
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


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


class ExperimentNotFoundError(StorageError):
    """No experiment of the given name exists in the storage."""
