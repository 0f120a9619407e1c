"""Users' tokens in the service's database: issued once, stored as hashes, revoked at once;
a jobs table from before users keeps its jobs."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest
import sqlalchemy as sa

from hybridtrain.service.errors import JobNotFoundError, JobSpecError
from hybridtrain.service.spec import load_job_spec
from hybridtrain.service.store import JOBS, JobStore
from hybridtrain.service.users import ADMIN, User, UserStore


def test_a_token_is_shown_once_stored_as_its_hash_and_revoked_at_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    users = UserStore(url)
    token = users.issue("alice", devices=2)
    assert users.find(token) == User("alice", admin=False, devices=2)
    stored = sqlite3.connect(tmp_path / "s.db").execute(
        "select token_sha256 from hybridtrain_service_users").fetchall()
    assert stored == [(hashlib.sha256(token.encode()).hexdigest(),)]  # never the token itself
    newer = users.issue("alice", devices=3)  # a new token replaces the old one
    assert users.find(token) is None and users.find(newer) == User("alice", False, 3)
    users.issue("bob", admin=True)
    assert [u.name for u in users.users()] == ["alice", "bob"] and users.quotas() == {"alice": 3}
    users.revoke("alice")
    assert users.find(newer) is None and users.find("") is None and users.find(None) is None
    with pytest.raises(JobNotFoundError, match="user 'alice' not found"):
        users.revoke("alice")


@pytest.mark.parametrize(("name", "devices", "field"), [
    ("Alice", None, "user name 'Alice'"), ("admin", None, "user name 'admin'"),
    ("a b", None, "user name 'a b'"), ("carol", 0, "user field devices = 0"),
    ("carol", True, "user field devices = True")])
def test_a_bad_name_or_quota_is_refused_in_one_line(tmp_path: Path, name: str, devices: int | None,
                                                    field: str) -> None:
    users = UserStore(f"sqlite:///{tmp_path / 's.db'}")
    with pytest.raises(JobSpecError, match=f"^{field}") as caught:
        users.issue(name, devices=devices)
    assert "\n" not in str(caught.value) and users.users() == []


def test_who_sees_a_job() -> None:
    assert ADMIN.may_see("alice") and ADMIN.may_see(None)
    alice = User("alice")
    assert alice.may_see("alice") and not alice.may_see("bob") and not alice.may_see(None)


def test_a_jobs_table_from_before_users_gains_the_column_and_keeps_its_jobs(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    old = sa.MetaData()
    columns = [sa.Column(c.name, c.type, nullable=c.nullable, primary_key=c.primary_key)
               for c in JOBS.columns if c.name != "submitter"]
    sa.Table(JOBS.name, old, *columns)
    engine = sa.create_engine(url)
    old.create_all(engine)
    spec = load_job_spec({"name": "old-job", "command": ["true"], "workdir": str(tmp_path)})
    with engine.begin() as conn:
        conn.execute(sa.text(
            f"insert into {JOBS.name} (name, spec_json, state, reason, priority, kind, job_dir, "
            "attempt, restarts, devices_json, history_json, created_at, queued_at) values "
            "('old-job', :spec, 'succeeded', '', 0, 'job', '/x', 1, 0, '[]', '[]', 1, 1)"),
            {"spec": spec.model_dump_json()})
    engine.dispose()
    store = JobStore(url)
    assert store.get("old-job").submitter is None
    new = store.submit(load_job_spec({"name": "new-job", "command": ["true"], "workdir": str(tmp_path)}),
                       str(tmp_path / "new-job"), submitter="alice")
    assert new.submitter == "alice" and new.as_dict()["submitter"] == "alice"
    JobStore(url)  # opening again adds nothing twice

