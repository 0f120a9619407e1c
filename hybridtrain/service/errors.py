"""Exceptions of the training service.

They derive from the servers' shared kinds (:mod:`hybridtrain.server.errors`), not from
the HPO service's: one REST app serves both, and its error handler maps a not-found to
404, a bad spec to 422 and a conflict to 409 by kind
(:func:`hybridtrain.server.errors.error_status`); the CLI prints every one as one line.
"""

from __future__ import annotations

from hybridtrain.server.errors import ConflictError, InvalidRequestError, NotFoundError, ServerError


class JobError(ServerError):
    """Base class of every error raised by :mod:`hybridtrain.service`."""


class JobSpecError(JobError, InvalidRequestError):
    """A job spec failed validation (raised before anything is stored or started)."""


class JobNotFoundError(JobError, NotFoundError):
    """No job of the given name or id exists in the storage."""


class JobConflictError(JobError, ConflictError):
    """The request conflicts with the job's state or with another job (a name in use)."""


class BackendError(JobError):
    """A backend (Ray, Kubernetes) cannot be reached or refused the job."""
