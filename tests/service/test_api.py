"""The service's REST API and page on the HPO service's stack: the same token, body limit
and error answers on /v1/jobs, a token-guarded jobs page, both services' series on one
/metrics, and job names that cannot leave the jobs directory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from hybridtrain.service.spec import load_job_spec
from tests.service.conftest import AUTH, TOKEN, api_client, wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def client(storage: str, tmp_path: Path) -> TestClient:
    return api_client(storage, tmp_path / "jobs")


def test_jobs_api_needs_the_token_and_bounds_bodies(client: TestClient) -> None:
    assert client.get("/v1/jobs").status_code == 401
    assert client.post("/v1/jobs", json={"command": ["true"]}).status_code == 401
    big = {"command": ["echo", "x" * (2 << 20)]}
    assert client.post("/v1/jobs", json=big, headers=AUTH).status_code == 413
    assert client.get("/metrics").status_code == 401
    assert client.get("/jobs/").status_code == 401
    # Bad input: one line naming the field, before anything is stored.
    bad = client.post("/v1/jobs", json={"command": ["true"], "devices": -1}, headers=AUTH)
    assert bad.status_code == 422 and "devices" in bad.json()["detail"]
    escape = client.post("/v1/jobs", json={"name": "../../etc", "command": ["true"]},
                         headers=AUTH)
    assert escape.status_code == 422 and "name" in escape.json()["detail"]
    logname = client.post("/v1/jobs", json={"command": ["true"], "stdout_file": "../x.log"},
                          headers=AUTH)
    assert logname.status_code == 422 and "stdout_file" in logname.json()["detail"]
    nowhere = client.post("/v1/jobs", json={"command": ["true"], "workdir": "/no/such/dir"},
                          headers=AUTH)
    assert nowhere.status_code == 422 and "workdir = '/no/such/dir'" in nowhere.json()["detail"]
    no_config = client.post("/v1/jobs", json={"config": "/no/such.yaml"}, headers=AUTH)
    assert no_config.status_code == 422 and "config" in no_config.json()["detail"]
    ray = client.post("/v1/jobs", json={"command": ["true"], "backend": "ray"}, headers=AUTH)
    assert ray.status_code == 422 and "not enabled" in ray.json()["detail"]
    assert client.get("/v1/jobs/none", headers=AUTH).status_code == 404
    assert client.get("/v1/jobs", headers=AUTH).json() == []


def test_submit_watch_logs_page_and_metrics(client: TestClient, tmp_path: Path) -> None:
    service = client.app.state.service  # type: ignore[attr-defined]
    job = client.post("/v1/jobs", headers=AUTH, json={
        "name": "hello", "command": [sys.executable, "-S", "-c", "print('hi there')"],
        "workdir": str(tmp_path)}).json()
    assert job["state"] == "queued" and job["job_dir"] == str(tmp_path / "jobs" / "hello")
    again = client.post("/v1/jobs", headers=AUTH, json={"name": "hello", "command": ["true"]})
    assert again.status_code == 409
    wait_for(lambda: client.get("/v1/jobs/hello", headers=AUTH).json()["state"] == "succeeded",
             30, "the job to succeed", service.scheduler.tick)
    logs = client.get("/v1/jobs/hello/logs", headers=AUTH).json()
    assert "hi there" in logs["text"] and logs["offset"] > 0
    tail = client.get(f"/v1/jobs/hello/logs?offset={logs['offset']}", headers=AUTH).json()
    assert tail["text"] == ""
    assert client.post("/v1/jobs/hello/cancel", headers=AUTH).json()["state"] == "succeeded"
    assert client.post("/v1/jobs/hello/resubmit", headers=AUTH).json()["state"] == "queued"
    assert client.post("/v1/jobs/hello/resubmit", headers=AUTH).status_code == 409
    cancelled = client.post("/v1/jobs/hello/cancel", headers=AUTH).json()
    assert cancelled["state"] == "cancelled"

    metrics = client.get("/metrics", headers=AUTH).text
    assert 'hybridtrain_service_jobs{state="cancelled"} 1.0' in metrics
    assert "hybridtrain_service_devices{kind=\"cpu\"} 2.0" in metrics
    assert 'hybridtrain_service_job_restarts{job_name="hello"} 0.0' in metrics
    assert "hybridtrain_hpo_up 1.0" in metrics  # one /metrics for both services

    login = client.get(f"/jobs/?token={TOKEN}", follow_redirects=False)
    assert login.status_code == 303 and "HttpOnly" in login.headers["set-cookie"]
    page = client.get("/jobs/")
    assert page.status_code == 200 and "hybridtrain jobs" in page.text
    data = client.get("/jobs/_data").json()
    assert [j["name"] for j in data["jobs"]] == ["hello"]
    detail = client.get("/jobs/_data/hello").json()
    assert "hi there" in detail["log"] and len(detail["job"]["history"]) == 1
    assert client.get("/jobs/_data/none").status_code == 404


def test_curve_of_a_training_job(client: TestClient, tmp_path: Path) -> None:
    service = client.app.state.service  # type: ignore[attr-defined]
    job = service.store.submit(load_job_spec({"name": "t", "config": str(tmp_path / "c.yaml")}),
                               str(tmp_path / "jobs" / "t"))
    run = Path(job.job_dir) / "run"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 3.5}\n{"step": 2, "loss": 3.0}\n'
                                       'not json\n{"step": 2, "eval_loss": 3.1}\n')
    curve = client.get("/v1/jobs/t/curve", headers=AUTH).json()
    assert curve == {"name": "t", "steps": [1, 2], "loss": [3.5, 3.0]}
