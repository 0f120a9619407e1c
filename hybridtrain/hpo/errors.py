"""Exceptions of the HPO service.

Every error a user can cause carries a one-line message that names the field or the
resource, the offending value and what is allowed, so the CLI can print it as is.
"""

from __future__ import annotations


class HPOError(Exception):
    """Base class of every error raised by :mod:`hybridtrain.hpo`."""


class SpecError(HPOError, ValueError):
    """An experiment spec failed validation (raised before any work starts)."""


class ExperimentConflictError(SpecError):
    """An experiment of that name is stored with a different search definition."""


class StorageError(HPOError):
    """The experiment storage cannot be opened or does not hold what was asked for."""


class ExperimentNotFoundError(StorageError):
    """No experiment of the given name exists in the storage."""
