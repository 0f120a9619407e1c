"""Exceptions of the HPO service.

Every error a user can cause carries a one-line message that names the field or the
resource, the offending value and what is allowed, so the CLI can print it as is. They
derive from the servers' shared kinds (:mod:`hybridtrain.server.errors`), which also give
the storage's errors (:class:`StorageError`, :class:`StorageFullError`, re-exported here).
"""

from __future__ import annotations

from hybridtrain.server.errors import (
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    ServerError,
    StorageError,
    StorageFullError,
)

__all__ = ["ExperimentConflictError", "ExperimentNotFoundError", "HPOError", "SpecError",
           "StorageError", "StorageFullError"]


class HPOError(ServerError):
    """Base class of the errors :mod:`hybridtrain.hpo` raises itself (the storage's
    :class:`StorageError` is a :class:`~hybridtrain.server.errors.ServerError`, not one)."""


class SpecError(HPOError, InvalidRequestError):
    """An experiment spec failed validation (raised before any work starts)."""


class ExperimentConflictError(SpecError, ConflictError):
    """An experiment of that name is stored with a different search definition."""


class ExperimentNotFoundError(HPOError, NotFoundError):
    """No experiment of the given name exists in the storage."""
