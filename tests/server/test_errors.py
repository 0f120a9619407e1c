"""The services' error kinds: each service's own classes, one HTTP status per kind."""

from __future__ import annotations

import pytest

from hybridtrain.hpo.errors import ExperimentConflictError, ExperimentNotFoundError, HPOError, SpecError
from hybridtrain.server.errors import ServerError, StorageError, StorageFullError, error_status, storage_error
from hybridtrain.service.errors import BackendError, JobConflictError, JobError, JobNotFoundError, JobSpecError


@pytest.mark.parametrize(("error", "status"), [
    (ExperimentNotFoundError("x"), 404), (JobNotFoundError("x"), 404),
    (ExperimentConflictError("x"), 409), (JobConflictError("x"), 409),
    (SpecError("x"), 422), (JobSpecError("x"), 422),
    (StorageFullError("x"), 507), (StorageError("x"), 503),
    (BackendError("x"), 409), (HPOError("x"), 409), (ServerError("x"), 409),
])
def test_each_kind_has_one_status(error: ServerError, status: int) -> None:
    assert error_status(error) == status


def test_the_services_errors_are_their_own() -> None:
    for job_error in (JobError, JobSpecError, JobNotFoundError, JobConflictError, BackendError):
        assert issubclass(job_error, ServerError) and not issubclass(job_error, HPOError)
    for hpo_error in (HPOError, SpecError, ExperimentNotFoundError, ExperimentConflictError):
        assert not issubclass(hpo_error, JobError)
    # A bad spec of either service is still a ValueError, as before.
    assert issubclass(JobSpecError, ValueError) and issubclass(SpecError, ValueError)


def test_a_full_disk_is_told_apart_from_an_unreachable_storage() -> None:
    full = storage_error(OSError(28, "No space left on device"))
    assert isinstance(full, StorageFullError) and "free space" in str(full)
    gone = storage_error(OSError(13, "Permission denied"))
    assert type(gone) is StorageError and str(gone) == "storage unavailable: [Errno 13] Permission denied"
