"""Exceptions of the training service.

They subclass the HPO service's errors on purpose: the service answers both over one REST
app, whose error handler maps a not-found to 404, a bad spec to 422 and a conflict to 409
(:func:`hybridtrain.hpo.api.create_app`), and the CLI prints every one as one line.
"""

from __future__ import annotations

from hybridtrain.hpo.errors import (
    ExperimentConflictError,
    ExperimentNotFoundError,
    HPOError,
    SpecError,
)


class JobError(HPOError):
    """Base class of every error raised by :mod:`hybridtrain.service`."""


class JobSpecError(JobError, SpecError):
    """A job spec failed validation (raised before anything is stored or started)."""


class JobNotFoundError(JobError, ExperimentNotFoundError):
    """No job of the given name or id exists in the storage."""


class JobConflictError(JobError, ExperimentConflictError):
    """The request conflicts with the job's state or with another job (a name in use)."""


class BackendError(JobError):
    """A backend (Ray, Kubernetes) cannot be reached or refused the job."""
