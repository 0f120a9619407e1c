"""The shared storage: URLs (and the variables they come from), one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridtrain.server.errors import StorageError
from hybridtrain.server.storage import open_engine, resolve_url
from hybridtrain.service.store import STORAGE_ENVS, JobStore


def test_urls() -> None:
    assert resolve_url("sqlite:///x.db", ()) == "sqlite:///x.db"
    assert resolve_url("postgresql://u:p@h/db", ()).startswith("postgresql+psycopg")
    with pytest.raises(StorageError, match="not a database URL"):
        resolve_url("hpo.db", ())
    with pytest.raises(StorageError, match="cannot open storage 'sqlite:////nonexistent/"):
        open_engine("sqlite:////nonexistent/dir/x.db")


def test_the_first_variable_set_wins_else_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    names = ("FIRST_URL", "SECOND_URL")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    assert resolve_url(None, names) == "sqlite:///hpo.db"
    monkeypatch.setenv("SECOND_URL", "sqlite:///second.db")
    assert resolve_url(None, names) == "sqlite:///second.db"
    monkeypatch.setenv("FIRST_URL", "sqlite:///first.db")
    assert resolve_url(None, names) == "sqlite:///first.db"
    monkeypatch.setenv("FIRST_URL", "")  # set but empty: as if unset
    assert resolve_url(None, names) == "sqlite:///second.db"


def test_the_service_reads_its_own_variable_then_the_hpo_one(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    assert STORAGE_ENVS == ("HYBRIDTRAIN_SERVICE_STORAGE", "HYBRIDTRAIN_HPO_STORAGE")
    shared = f"sqlite:///{tmp_path / 'shared.db'}"
    own = f"sqlite:///{tmp_path / 'service.db'}"
    monkeypatch.delenv("HYBRIDTRAIN_SERVICE_STORAGE", raising=False)
    monkeypatch.setenv("HYBRIDTRAIN_HPO_STORAGE", shared)
    assert JobStore().url == shared  # the documented fallback: one database for both
    monkeypatch.setenv("HYBRIDTRAIN_SERVICE_STORAGE", own)
    assert JobStore().url == own
