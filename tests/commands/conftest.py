"""Fixtures of the command tests, shared with the parts the commands drive: the HPO tests'
specs and storages, the service tests' running service."""

from tests.hpo.conftest import make_spec, sqlite_url  # noqa: F401
from tests.service.conftest import served  # noqa: F401
