"""The REST API: auth, validation, experiments end to end, and a fuzz pass (the token itself:
tests/server/test_auth.py)."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridtrain.hpo.api import create_app, launch_worker
from hybridtrain.hpo.experiments import ExperimentStore
from tests.hpo.conftest import serve_process

pytestmark = pytest.mark.timeout(180)
TOKEN = "t" * 32
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def client(sqlite_url: str) -> TestClient:
    return TestClient(create_app(ExperimentStore(sqlite_url), TOKEN, launcher=launch_worker))


def test_requests_without_or_with_a_wrong_token_are_refused(client: TestClient) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
        r = client.get("/v1/experiments", headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert client.post("/v1/experiments", json={}, headers=headers).status_code == 401
        assert client.get("/dashboard", headers=headers).status_code == 401
    assert client.get("/v1/experiments", headers=AUTH).json() == []
    assert "/v1/experiments/{name}/trials" in client.get("/openapi.json").json()["paths"]


def test_dashboard_login_with_token_sets_a_cookie(client: TestClient) -> None:
    r = client.get(f"/dashboard?token={TOKEN}", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/dashboard"
    page = client.get("/dashboard")  # the cookie now authorizes
    assert page.status_code == 200 and "<html" in page.text.lower()
    assert client.get("/api/studies").status_code == 200


def test_invalid_spec_is_422_with_one_line(client: TestClient, make_spec: Any) -> None:
    spec = make_spec()
    spec["parameters"]["x1"]["low"] = 50
    r = client.post("/v1/experiments", json=spec, headers=AUTH)
    assert r.status_code == 422
    assert r.json()["detail"].startswith("invalid experiment spec: field 'parameters.x1'")
    assert client.get("/v1/experiments", headers=AUTH).json() == []  # nothing stored


def test_experiment_lifecycle_over_http(client: TestClient, make_spec: Any) -> None:
    spec = make_spec(max_trials=4)
    r = client.post("/v1/experiments", json=spec, headers=AUTH)
    assert r.status_code == 201 and r.json()["state"] == "running"
    deadline = time.monotonic() + 120
    while client.get("/v1/experiments/branin", headers=AUTH).json()["state"] == "running":
        assert time.monotonic() < deadline, "the launched worker did not finish"
        time.sleep(0.2)
    got = client.get("/v1/experiments/branin", headers=AUTH).json()
    assert got["state"] == "succeeded" and got["trials"]["complete"] == 4
    assert got["spec"]["max_trials"] == 4
    trials = client.get("/v1/experiments/branin/trials", headers=AUTH).json()
    assert len(trials) == 4 and all("loss" in t["metrics"] for t in trials)
    best = client.get("/v1/experiments/branin/best", headers=AUTH).json()
    assert best["value"] == min(t["value"] for t in trials)
    conflict = client.post("/v1/experiments", json=make_spec(max_trials=5), headers=AUTH)
    assert conflict.status_code == 409 and "different spec" in conflict.json()["detail"]
    assert client.get("/v1/experiments/nope", headers=AUTH).status_code == 404
    assert client.post("/v1/experiments/nope/stop", headers=AUTH).status_code == 404


def test_stop_over_http(sqlite_url: str, make_spec: Any) -> None:
    client = TestClient(create_app(ExperimentStore(sqlite_url), TOKEN, launcher=None,
                                   dashboard=False))
    assert client.post("/v1/experiments", json=make_spec(), headers=AUTH).status_code == 201
    r = client.post("/v1/experiments/branin/stop", headers=AUTH)
    assert r.json()["state"] == "stopped"
    assert client.get("/v1/experiments/branin/best", headers=AUTH).status_code == 404


_scalars = (st.none() | st.booleans() | st.integers()
            | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8))
_json = st.recursive(_scalars,
                     lambda kids: st.lists(kids, max_size=3)
                     | st.dictionaries(st.text(max_size=8), kids, max_size=3), max_leaves=8)


@pytest.fixture(scope="module")
def fuzz_client(tmp_path_factory: pytest.TempPathFactory) -> TestClient:
    url = f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'fuzz.db'}"
    return TestClient(create_app(ExperimentStore(url), TOKEN, launcher=None, dashboard=False))


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(name=st.text(max_size=20), body=_json,
       field=st.sampled_from(["name", "objective", "parameters", "trial", "max_trials",
                              "algorithm", "early_stopping"]))
def test_fuzz_never_5xx(fuzz_client: TestClient, make_spec: Any, name: str, body: Any,
                        field: str) -> None:
    client = fuzz_client
    name = quote(name, safe="")
    spec = make_spec()
    spec[field] = body
    for response in (
        client.post("/v1/experiments", json=body, headers=AUTH),
        client.post("/v1/experiments", json=spec, headers=AUTH),
        client.get(f"/v1/experiments/{name}", headers=AUTH),
        client.get(f"/v1/experiments/{name}/trials", headers=AUTH),
        client.get(f"/v1/experiments/{name}/best", headers=AUTH),
        client.post(f"/v1/experiments/{name}/stop", headers=AUTH),
    ):
        assert response.status_code < 500, response.text


def test_serve_generates_prints_and_enforces_a_token(tmp_path: Path, sqlite_url: str) -> None:
    """The real server: token generated and printed on first start, loopback by default."""
    with serve_process(tmp_path, sqlite_url) as (_, base, out):
        printed = out.read_text()
        token = (tmp_path / "token").read_text().strip()
        assert f"generated API token (saved; set $HYBRIDTRAIN_HPO_TOKEN to override): {token}" \
            in printed, printed
        assert "warning: binding" not in printed

        def get(path: str, headers: dict[str, str]) -> int:
            request = urllib.request.Request(base + path, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    return int(response.status)
            except urllib.error.HTTPError as exc:
                return exc.code

        assert get("/v1/experiments", {}) == 401
        assert get("/v1/experiments", {"Authorization": f"Bearer {token}"}) == 200
        assert get("/dashboard", {}) == 401
