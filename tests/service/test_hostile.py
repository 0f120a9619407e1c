"""The training service against hostile and careless input (issue #36, items 2-4): one
parametrized test per class. Every request error is a one-line 4xx (507 when the storage
is full), never a 500; a job's own metrics cannot break its curve or page; ``serve``
refuses bad options in one line before it starts; jobs never see the service's token; the
service's files are its owner's only."""

from __future__ import annotations

import json
import socket
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from hybridtrain.commands.cli import main
from hybridtrain.service.devices import parse_slots
from hybridtrain.service.opening import make_backends, open_service
from tests.service.conftest import AUTH, TOKEN, api_client, wait_for

pytestmark = pytest.mark.timeout(120)
LONG = "a" * 5000


@pytest.fixture
def client(storage: str, tmp_path: Path) -> TestClient:
    return api_client(storage, tmp_path / "jobs", raise_server_exceptions=False)


def _one_line_4xx(response: Any, status: int, words: str) -> None:
    detail = response.json()["detail"]
    assert response.status_code == status, response.text
    assert isinstance(detail, str) and "\n" not in detail and words in detail, detail


BAD_REQUESTS = [
    ("POST", "/v1/jobs", b"1e999", "body"),
    ("POST", "/v1/jobs", b"[1e999]", "body"),
    ("POST", "/v1/jobs", json.dumps({"command": ["true"], "workdir": "/" + LONG}).encode(),
     "workdir"),
    ("POST", "/v1/jobs", json.dumps({"command": ["true"], "workdir": "/" + "b/" * 2000}).encode(),
     "workdir"),
    ("POST", "/v1/jobs", json.dumps({"config": LONG}).encode(), "config"),
    ("POST", "/v1/jobs", json.dumps({"config": "/tmp/" + "c" * 300 + ".yaml"}).encode(), "config"),
    ("POST", "/v1/jobs", json.dumps({"command": ["true"], "kill_grace": 1e308 * 10}
                                    ).replace("Infinity", "1e999").encode(), "kill_grace"),
    ("GET", "/v1/jobs/j/logs?offset=" + "9" * 30, b"", "offset"),
    ("GET", f"/v1/jobs/j/logs?offset={2**64}", b"", "offset"),
    ("GET", "/v1/jobs/j/logs?offset=-1", b"", "offset"),
]


@pytest.mark.parametrize(("method", "path", "body", "field"), BAD_REQUESTS,
                         ids=[f"{m} {p[:30]} {b[:30]!r}" for m, p, b, _ in BAD_REQUESTS])
def test_bad_requests_are_one_line_422(client: TestClient, tmp_path: Path, method: str,
                                       path: str, body: bytes, field: str) -> None:
    client.post("/v1/jobs", headers=AUTH, json={"name": "j", "command": ["true"],
                                                "workdir": str(tmp_path)})
    answer = client.request(method, path, content=body or None,
                            headers=AUTH | {"content-type": "application/json"})
    _one_line_4xx(answer, 422, field)


BAD_METRIC_LINES = [
    '{"step": Infinity, "loss": 1.0}',
    '{"step": 1e400, "loss": 1.0}',
    '{"step": NaN, "loss": 1.0}',
    '{"step": 1, "loss": Infinity}',
    '{"step": 1, "loss": -1e400}',
    '{"step": 1, "loss": NaN}',
    '{"step": 18446744073709551616, "loss": 1.0}',
    '{"step": -3, "loss": 1.0}',
    '{"step": 1, "loss": ' + "[" * 100_000 + "]" * 100_000 + "}",
    '{"step": 1, "loss": "1.0"}',
    "\xff\xfe not utf-8",
]


@pytest.mark.parametrize("line", BAD_METRIC_LINES, ids=[ln[:32] for ln in BAD_METRIC_LINES])
def test_a_jobs_hostile_metric_line_is_skipped_in_its_curve_and_page(
        client: TestClient, tmp_path: Path, line: str) -> None:
    client.post("/v1/jobs", headers=AUTH, json={"name": "j", "command": ["true"],
                                                "workdir": str(tmp_path)})
    run = tmp_path / "jobs" / "j" / "run"
    run.mkdir(parents=True)
    good = '{"step": 2, "loss": 0.5}'
    (run / "metrics.jsonl").write_bytes(f"{line}\n{good}\n".encode("utf-8", "surrogateescape"))
    curve = client.get("/v1/jobs/j/curve", headers=AUTH)
    assert curve.status_code == 200 and curve.json() == {"name": "j", "steps": [2], "loss": [0.5]}
    page = client.get("/jobs/_data/j", headers=AUTH)
    assert page.status_code == 200 and page.json()["curve"]["steps"] == [2]
    assert page.json()["progress"]["step"] == 2 and page.json()["progress"]["loss"] == 0.5


def _fill_up(engine: sa.engine.Engine) -> None:
    """Cap the SQLite file at its present size (SQLITE_FULL from the next page on), as a
    full disk under the storage does."""

    @sa.event.listens_for(engine, "connect")
    def _cap(dbapi_conn: Any, _record: Any) -> None:
        pages = dbapi_conn.execute("PRAGMA page_count").fetchone()[0]
        dbapi_conn.execute(f"PRAGMA max_page_count = {pages}")

    engine.dispose()


def test_a_full_storage_answers_507_in_one_line_and_keeps_finished_jobs(
        client: TestClient, tmp_path: Path) -> None:
    service = client.app.state.service  # type: ignore[attr-defined]
    done = client.post("/v1/jobs", headers=AUTH, json={"name": "done", "command": ["true"],
                                                        "workdir": str(tmp_path)})
    assert done.status_code == 201
    wait_for(lambda: service.store.get("done").state == "succeeded", 30, "the job to end",
             service.scheduler.tick)
    _fill_up(service.store.engine)
    for i in range(20):  # enough rows to need a new page
        answer = client.post("/v1/jobs", headers=AUTH, json={
            "name": f"big{i}", "command": ["true"], "workdir": str(tmp_path),
            "env": {"PAD": "x" * 20000}})
        if answer.status_code != 201:
            break
    _one_line_4xx(answer, 507, "storage is full")
    assert client.get("/v1/jobs/done", headers=AUTH).json()["state"] == "succeeded"


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str]]:
    """``hybridtrain ARGS`` in this process: ``(exit code, stderr)``."""
    monkeypatch.setenv("HYBRIDTRAIN_HPO_TOKEN", TOKEN)
    monkeypatch.delenv("HYBRIDTRAIN_SERVER", raising=False)
    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> tuple[int, str]:
        code = main([*args, "--storage", f"sqlite:///{tmp_path / 's.db'}"])
        return code, capsys.readouterr().err

    return run


@pytest.fixture
def busy_port() -> Any:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


BAD_SERVE = [
    (["--port", "70000"], "--port 70000 is not a TCP port"),
    (["--port", "-1"], "--port -1 is not a TCP port"),
    (["--host", "256.1.1.1"], "--host '256.1.1.1' is not an IP address"),
    (["--host", "no-such-host.invalid"], "does not resolve"),
    (["--host", "192.0.2.1"], "is not an address of this machine"),
    (["--lease", "nan"], "--lease nan: give seconds"),
    (["--lease", "inf"], "--lease inf: give seconds"),
    (["--lease", "0"], "--lease 0.0: give seconds"),
    (["--jobs-dir", "{file}"], "is a file, not a directory"),
    (["--jobs-dir", "{file}/sub"], "is a file, not a directory"),
    (["--token-file", "/proc/self/nonexistent/tok"], "token file '/proc/self/nonexistent/tok'"),
    (["--port", "{busy}"], "is in use"),
    (["--kubernetes", "ns"], "no Kubernetes cluster configured"),
    (["--ray", "http://127.0.0.1:9"], "cannot reach the Ray job server at http://127.0.0.1:9"),
]


@pytest.mark.parametrize(("args", "words"), BAD_SERVE, ids=[" ".join(a) for a, _ in BAD_SERVE])
def test_serve_refuses_bad_options_in_one_line_before_starting(
        cli: Callable[..., tuple[int, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        busy_port: int, args: list[str], words: str) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    if "--token-file" in args:
        monkeypatch.delenv("HYBRIDTRAIN_HPO_TOKEN")
    (tmp_path / "file").write_text("x")
    args = [a.format(file=tmp_path / "file", busy=busy_port) for a in args]
    code, err = cli("serve", "--port", "0", *args)
    assert code == 2 and err.count("\n") == 1 and words in err, err
    assert "Traceback" not in err


def test_jobs_commands_refuse_a_bad_token_path_in_one_line(
        cli: Callable[..., tuple[int, str]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYBRIDTRAIN_HPO_TOKEN")
    code, err = cli("jobs", "list", "--token-file", "/proc/self/nonexistent/tok")
    assert code == 2 and err.count("\n") == 1 and "token file" in err, err


def test_jobs_never_see_the_services_secrets(client: TestClient, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDTRAIN_HPO_TOKEN", TOKEN)
    monkeypatch.setenv("HYBRIDTRAIN_HPO_STORAGE", "postgresql://u:hunter2-secret@db/x")
    monkeypatch.setenv("PGPASSWORD", "hunter2-secret")
    monkeypatch.setenv("HARMLESS_VAR", "kept")
    service = client.app.state.service  # type: ignore[attr-defined]
    client.post("/v1/jobs", headers=AUTH, json={
        "name": "env", "workdir": str(tmp_path),
        "command": [sys.executable, "-S", "-c",
                    "import os; print(sorted(os.environ.items()))"]})
    wait_for(lambda: service.store.get("env").state == "succeeded", 30, "the job to end",
             service.scheduler.tick)
    log = client.get("/v1/jobs/env/logs", headers=AUTH).json()["text"]
    assert "HARMLESS_VAR" in log
    assert TOKEN not in log and "hunter2" not in log and "HYBRIDTRAIN_HPO" not in log


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_services_database_and_files_are_its_owners_only(tmp_path: Path) -> None:
    slots = parse_slots("cpu:1")
    service = open_service(f"sqlite:///{tmp_path / 'jobs.db'}", tmp_path / "jobs", None,
                           make_backends(slots), slots)
    service.submit({"name": "p", "command": ["true"], "workdir": str(tmp_path)})
    wait_for(lambda: service.store.get("p").state == "succeeded", 30, "the job to end",
             service.scheduler.tick)
    job_dir = tmp_path / "jobs" / "p"
    for path in (tmp_path / "jobs.db", tmp_path / "jobs.db.lock", tmp_path / "jobs.db-wal",
                 job_dir / "output.log", job_dir / "attempt-1.exit", job_dir / "attempt-1.pid",
                 job_dir / "attempt-1.lock"):
        assert _mode(path) == 0o600, path
    assert _mode(job_dir) == 0o700 and _mode(tmp_path / "jobs") == 0o700
