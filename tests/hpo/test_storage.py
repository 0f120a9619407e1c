"""The experiments' storage: Optuna's tables beside ours, SQLite settings for several workers,
racing table creation, its URL variable."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hybridtrain.hpo.records import Records
from hybridtrain.hpo.storage import open_optuna_storage, resolve_url
from hybridtrain.server.storage import open_engine

pytestmark = pytest.mark.timeout(120)


def test_workers_starting_together_on_a_fresh_database(tmp_path: Path) -> None:
    # Every one of them sees no tables and creates them; the losers must not fail.
    for round_ in range(3):
        url = f"sqlite:///{tmp_path / f'fresh{round_}.db'}"
        errors: list[BaseException] = []

        def open_all(url: str = url, errors: list[BaseException] = errors) -> None:
            try:
                Records(open_engine(url))
                open_optuna_storage(url)
            except BaseException as exc:  # collected for the assertion below
                errors.append(exc)

        threads = [threading.Thread(target=open_all) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []


def test_sqlite_is_opened_for_concurrent_controllers(sqlite_url: str) -> None:
    engine = open_engine(sqlite_url)
    with engine.connect() as conn:
        raw = conn.connection.driver_connection
        assert raw is not None
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        # Writers queue on the file lock: a generous busy timeout, not pysqlite's 5 s.
        assert raw.execute("PRAGMA busy_timeout").fetchone()[0] >= 30_000
    # The WAL is synced at checkpoints, not per commit (1 = NORMAL), on Optuna's
    # connections too.
    for eng in (engine, open_optuna_storage(sqlite_url).engine):
        with eng.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 1


def test_a_commit_survives_its_process_killed_right_after(tmp_path: Path) -> None:
    """synchronous=NORMAL keeps commits across kill -9 (only power loss may drop them)."""
    url = f"sqlite:///{tmp_path / 'hpo.db'}"
    script = (
        "import os, signal, sys\n"
        "from hybridtrain.hpo.storage import open_optuna_storage\n"
        "storage = open_optuna_storage(sys.argv[1])\n"
        "study = storage.create_new_study([], 'killed')\n"
        "for i in range(20):\n"
        "    storage.set_trial_user_attr(storage.create_new_trial(study), 'i', i)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    open_engine(url).dispose()  # WAL, as a controller leaves the file
    proc = subprocess.run([sys.executable, "-c", script, url], timeout=120)
    assert proc.returncode == -signal.SIGKILL
    storage = open_optuna_storage(url)
    trials = storage.get_all_trials(storage.get_study_id_from_name("killed"))
    assert [t.user_attrs["i"] for t in trials] == list(range(20))


def test_the_experiments_url_comes_from_the_hpo_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDTRAIN_SERVICE_STORAGE", "sqlite:///service.db")
    monkeypatch.setenv("HYBRIDTRAIN_HPO_STORAGE", "sqlite:///hpo-env.db")
    assert resolve_url(None) == "sqlite:///hpo-env.db"
    assert resolve_url("sqlite:///given.db") == "sqlite:///given.db"
