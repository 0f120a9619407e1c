"""Experiment storage: one SQL database holds Optuna's tables and our own two tables.

Optuna's RDB storage keeps studies, trials, parameters and reported values. Next to it,
:mod:`hybridtrain.hpo.records` keeps one row per experiment (spec, state, failure count)
and one row per trial *slot* with its lease. The database itself (URL, engine, set-up
lock) is the servers' shared storage, :mod:`hybridtrain.server.storage`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridtrain.server.errors import StorageError, first_line
from hybridtrain.server.storage import (
    HPO_STORAGE_ENV,
    create_tables_racing,
    engine_kwargs,
    safe_url,
    setup_lock,
)
from hybridtrain.server.storage import resolve_url as resolve_storage_url

if TYPE_CHECKING:
    import optuna

#: The experiments' storage URL when none is given.
STORAGE_ENV = HPO_STORAGE_ENV


def resolve_url(url: str | None) -> str:
    """The storage URL to use: ``url``, else ``$HYBRIDTRAIN_HPO_STORAGE``, else ``hpo.db``.

    Raises:
        StorageError: the URL is not a SQLAlchemy database URL of a supported backend.
    """
    return resolve_storage_url(url, (STORAGE_ENV,))


def open_optuna_storage(url: str) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage on ``url`` (tables created on first use).

    Raises:
        StorageError: the database cannot be reached or initialized.
    """
    import optuna
    import sqlalchemy

    try:
        # Optuna sets a new database up in several steps (tables, version row, alembic
        # stamp); a second worker starting in between would find a half-made schema.
        with setup_lock(url):
            return create_tables_racing(
                lambda: optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs(url)))
    except (sqlalchemy.exc.SQLAlchemyError, RuntimeError, OSError) as exc:
        raise StorageError(f"cannot open storage {safe_url(url)!r}: {first_line(exc)}") from None
