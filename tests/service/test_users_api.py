"""Users of the service over its REST app and page: a user's token opens their own jobs
only, within their device quota; the HPO routes and /metrics stay the administrator's; a
revoked token fails at once; the scheduler shares devices fairly and keeps quotas."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.service.conftest import AUTH, TOKEN, api_client

pytestmark = pytest.mark.timeout(120)


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _sleeper(name: str, tmp_path: Path, devices: int = 1) -> dict[str, Any]:
    return {"name": name, "devices": devices, "workdir": str(tmp_path),
            "command": [sys.executable, "-S", "-c", "import time; time.sleep(60)"]}


def test_a_user_sees_and_moves_only_their_own_jobs(storage: str, tmp_path: Path) -> None:
    client = api_client(storage, tmp_path / "jobs")
    service = client.app.state.service  # type: ignore[attr-defined]
    alice = _bearer(service.users.issue("alice", devices=1))
    bob_token = service.users.issue("bob")
    bob = _bearer(bob_token)
    for who, name in ((alice, "a-job"), (bob, "b-job"), (AUTH, "admin-job")):
        assert client.post("/v1/jobs", headers=who, json=_sleeper(name, tmp_path)).status_code == 201
    assert service.store.get("a-job").submitter == "alice" and service.store.get("admin-job").submitter is None
    assert [j["name"] for j in client.get("/v1/jobs", headers=alice).json()] == ["a-job"]
    assert {j["name"] for j in client.get("/v1/jobs", headers=AUTH).json()} == {"a-job", "b-job", "admin-job"}
    # Another user's job does not exist for alice: read, logs, cancel and resubmit are 404.
    for method, path in (("get", "/v1/jobs/b-job"), ("get", "/v1/jobs/b-job/logs"),
                         ("get", "/v1/jobs/b-job/curve"), ("post", "/v1/jobs/b-job/cancel"),
                         ("post", "/v1/jobs/b-job/resubmit")):
        assert getattr(client, method)(path, headers=alice).status_code == 404, path
    assert service.store.get("b-job").state == "queued"
    assert client.post("/v1/jobs/a-job/cancel", headers=alice).json()["state"] == "cancelled"
    assert client.get("/v1/service", headers=alice).json()["jobs"] == {"cancelled": 1}
    # Over the quota at submit: refused in one line, nothing queued.
    big = client.post("/v1/jobs", headers=alice, json=_sleeper("a-big", tmp_path, devices=2))
    assert big.status_code == 422 and "user alice may hold at most 1 devices" in big.json()["detail"]
    # The HPO service and /metrics are the administrator's.
    assert client.get("/v1/experiments", headers=alice).status_code == 401
    assert client.get("/metrics", headers=alice).status_code == 401
    # The page, logged in with a user's token, shows that user's jobs.
    login = client.get(f"/jobs/?token={bob_token}", follow_redirects=False)
    assert login.status_code == 303
    assert [j["name"] for j in client.get("/jobs/_data").json()["jobs"]] == ["b-job"]
    assert client.get("/jobs/_data/a-job").status_code == 404
    assert client.post("/jobs/a-job/cancel", headers={"X-Hybridtrain-Page": "1"}).status_code == 404
    # Revoked: the next request fails, on the API and on the page.
    service.users.revoke("bob")
    assert client.get("/v1/jobs", headers=bob).status_code == 401
    assert client.get("/jobs/_data").status_code == 401
    assert client.get(f"/jobs/?token={TOKEN}", follow_redirects=False).status_code == 303
    assert len(client.get("/jobs/_data").json()["jobs"]) == 3  # the administrator sees all


def test_the_scheduler_shares_devices_fairly_and_keeps_quotas(storage: str, tmp_path: Path) -> None:
    client = api_client(storage, tmp_path / "jobs", slots="cpu:2")
    service = client.app.state.service  # type: ignore[attr-defined]
    alice = _bearer(service.users.issue("alice", devices=1))
    bob = _bearer(service.users.issue("bob"))
    try:
        for name in ("a1", "a2"):
            client.post("/v1/jobs", headers=alice, json=_sleeper(name, tmp_path))
            time.sleep(0.01)
        client.post("/v1/jobs", headers=bob, json=_sleeper("b1", tmp_path))
        service.scheduler.tick()
        running = {j["name"] for j in client.get("/v1/jobs?state=running", headers=AUTH).json()}
        # Two free cores: alice's first job, then bob's (alice's quota of 1 holds a2 back
        # although a core would be free for it, and it waited longer than b1).
        assert running == {"a1", "b1"}
        positions = {j["name"]: j["queue_position"] for j in client.get("/v1/jobs", headers=AUTH).json()}
        assert positions == {"a1": None, "a2": 1, "b1": None}
    finally:
        for name in ("a1", "a2", "b1"):
            client.post(f"/v1/jobs/{name}/cancel", headers=AUTH)
        service.scheduler.tick()
