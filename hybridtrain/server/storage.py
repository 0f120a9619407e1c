"""The services' storage: one SQL database, its URL, its engine and its set-up lock.

The HPO service keeps Optuna's tables and its own there (:mod:`hybridtrain.hpo.storage`,
:mod:`hybridtrain.hpo.records`), the training service its jobs
(:mod:`hybridtrain.service.store`); ``hybridtrain serve`` puts both in one database. A
SQLite file is the default (nothing to start); a PostgreSQL URL lets processes on many
machines share it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from hybridtrain.server.errors import StorageError, first_line

if TYPE_CHECKING:
    import sqlalchemy

T = TypeVar("T")
#: The HPO service's storage URL; the training service falls back to it.
HPO_STORAGE_ENV = "HYBRIDTRAIN_HPO_STORAGE"
#: The training service's storage URL.
SERVICE_STORAGE_ENV = "HYBRIDTRAIN_SERVICE_STORAGE"
#: Where either service keeps its tables unless told otherwise (the same file: ``serve``
#: hosts both).
DEFAULT_STORAGE = "sqlite:///hpo.db"
# SQLite writers queue on a file lock; several controllers plus their heartbeat threads
# need far more patience than pysqlite's default 5 s.
_SQLITE_TIMEOUT_S = 60
# How long a controller keeps retrying table creation that raced with another's.
_CREATE_RACE_S = 30
# Advisory-lock key of storage set-up on PostgreSQL (any constant unique to this use).
_PG_LOCK = 0x687470_6F5F7375  # "htpo_su"


def resolve_url(url: str | None, env_names: Sequence[str]) -> str:
    """The storage URL to use: ``url``, else the first of ``env_names`` that is set, else
    ``sqlite:///hpo.db``.

    Raises:
        StorageError: the URL is not a SQLAlchemy database URL of a supported backend.
    """
    chosen = url or next((os.environ[name] for name in env_names if os.environ.get(name)),
                         DEFAULT_STORAGE)
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(chosen)
    except ArgumentError:
        raise StorageError(
            f"storage URL {chosen!r} is not a database URL; use sqlite:///PATH or "
            "postgresql://USER@HOST/DB"
        ) from None
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise StorageError(
            f"storage URL {safe_url(chosen)!r}: backend {parsed.get_backend_name()!r} is not "
            "supported; use sqlite:///PATH or postgresql://USER@HOST/DB"
        )
    if parsed.drivername == "postgresql":
        # SQLAlchemy >= 2.1 maps a bare postgresql:// to psycopg 3; use whichever driver
        # is installed (the hpo extra ships psycopg2-binary).
        chosen = parsed.set(drivername=f"postgresql+{_pg_driver()}").render_as_string(
            hide_password=False)
    return chosen


def _pg_driver() -> str:
    import importlib.util

    for module, driver in (("psycopg2", "psycopg2"), ("psycopg", "psycopg")):
        if importlib.util.find_spec(module) is not None:
            return driver
    raise StorageError("a postgresql:// storage needs a driver; pip install psycopg2-binary")


def safe_url(url: str) -> str:
    """``url`` with any password masked, for messages."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # an unparsable URL has no password we could find
        return url


class _NormalSyncConnection(sqlite3.Connection):
    """A SQLite connection that syncs the write-ahead log at checkpoints, not per commit.

    In WAL mode ``synchronous=NORMAL`` keeps every commit across a crash of the process
    (``kill -9`` of a controller loses nothing); only a power loss or an operating-system
    crash can roll back the last commits, and then to a consistent earlier state (slots
    and Optuna's trials live in the same file, so they roll back together and the lost
    trials run again). It saves an ``fsync`` per commit, and a trial makes about eight
    (``benchmarks/hpo_overhead.py``). SQLite's own recommendation for WAL:
    https://www.sqlite.org/pragma.html#pragma_synchronous
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.execute("PRAGMA synchronous=NORMAL")


def engine_kwargs(url: str) -> dict[str, Any]:
    """SQLAlchemy engine options of every engine on ``url`` (ours and Optuna's)."""
    if url.startswith("sqlite"):
        # pysqlite passes connect_args to sqlite3.connect, whose public ``factory``
        # argument sets the pragma on every connection of both engines (ours, Optuna's).
        return {"connect_args": {"timeout": _SQLITE_TIMEOUT_S,
                                 "factory": _NormalSyncConnection}}
    return {"pool_pre_ping": True}


def open_engine(url: str) -> sqlalchemy.engine.Engine:
    """A SQLAlchemy engine on ``url`` for our own tables, checked to be reachable.

    Raises:
        StorageError: the database cannot be reached (one line, password masked).
    """
    import sqlalchemy

    try:
        engine = sqlalchemy.create_engine(url, **engine_kwargs(url))
    except ImportError as exc:
        raise StorageError(f"storage {safe_url(url)!r}: database driver missing ({exc})") from None
    try:
        with setup_lock(url), engine.connect() as conn:
            # WAL lets readers (status, dashboard) proceed while a controller writes. The
            # mode is stored in the file, so this is done once, under the set-up lock:
            # switching needs the database to itself and fails at once (busy timeout or
            # not) while another connection has it open.
            if url.startswith("sqlite") and conn.exec_driver_sql(
                    "PRAGMA journal_mode").scalar() != "wal":
                conn.exec_driver_sql("PRAGMA journal_mode=WAL")
    except (sqlalchemy.exc.SQLAlchemyError, OSError) as exc:
        engine.dispose()
        raise StorageError(f"cannot open storage {safe_url(url)!r}: {first_line(exc)}") from None
    return engine


def create_tables_racing(create: Callable[[], T]) -> T:
    """Run ``create`` (which creates tables if missing), retrying if a peer raced us.

    Two workers starting together on a fresh database both see no table and both try
    ``CREATE TABLE``; the loser gets a unique-violation on the catalog or "relation
    already exists" (PostgreSQL), or "table … already exists" (SQLite, an
    ``OperationalError``). By the retry the winner's tables exist and ``create`` only
    checks them. Any other error is raised at once.
    """
    import sqlalchemy

    # The winner may still be creating the rest of its tables when we retry (on a loaded
    # machine for a while), so retries go on for a time rather than a count.
    deadline = time.monotonic() + _CREATE_RACE_S
    delay = 0.05
    while True:
        try:
            return create()
        except sqlalchemy.exc.DatabaseError as exc:
            lost_race = isinstance(exc, (sqlalchemy.exc.IntegrityError,
                                         sqlalchemy.exc.ProgrammingError)) or (
                isinstance(exc, sqlalchemy.exc.OperationalError)
                and "already exists" in str(exc.orig))
            if not lost_race or time.monotonic() > deadline:
                raise
            time.sleep(delay)
            delay = min(2 * delay, 1.0)


def _private_opener(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


def _create_private(path: str) -> None:
    """Create ``path`` empty with mode 0600 unless it exists (SQLite takes an empty file
    for a new database)."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


@contextlib.contextmanager
def setup_lock(url: str) -> Iterator[None]:
    """Hold a lock that serializes storage set-up among all processes on ``url``.

    Workers starting together on a fresh database would otherwise race to switch it to
    WAL and to create the tables, and some steps of that fail at once instead of waiting.

    SQLite: ``flock`` on a file next to the database (``hpo.db.lock``), not on the
    database itself, whose locks SQLite manages. PostgreSQL: an advisory lock.
    """
    import sqlalchemy

    parsed = sqlalchemy.engine.make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if not parsed.database or parsed.database == ":memory:":
            yield
            return
        # The database holds every job's environment and every trial's command: created
        # readable by its owner only (SQLite gives its -wal and -shm files the same mode).
        _create_private(parsed.database)
        with open(f"{parsed.database}.lock", "a", opener=_private_opener) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield  # closing the file releases the lock
        return
    engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
    try:
        with engine.connect() as conn:
            conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:key)"), {"key": _PG_LOCK})
            try:
                yield
            finally:
                conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:key)"),
                             {"key": _PG_LOCK})
    finally:
        engine.dispose()


def open_with_tables(url: str, metadata: sqlalchemy.MetaData, what: str,
                     upgrade: Callable[[sqlalchemy.engine.Engine], None] | None = None
                     ) -> sqlalchemy.engine.Engine:
    """An engine on ``url`` with ``metadata``'s tables created (several processes may race to
    create them), then ``upgrade`` run on it, under the storage's set-up lock.

    Raises:
        StorageError: one line naming ``what`` (e.g. "the job tables") and the storage.
    """
    import sqlalchemy as sa

    engine = open_engine(url)
    try:
        with setup_lock(url):
            create_tables_racing(lambda: metadata.create_all(engine, checkfirst=True))
            if upgrade is not None:
                upgrade(engine)
    except (sa.exc.SQLAlchemyError, OSError) as exc:
        raise StorageError(f"cannot create {what} in {safe_url(url)!r}: {first_line(exc)}") from None
    return engine
