"""The REST API under abuse (issue 11, item 3): the token is checked before any body byte
is read, bodies are bounded (413), and finished workers do not stay zombies."""

from __future__ import annotations

import asyncio
import http.client
import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from fastapi.testclient import TestClient

from hybridtrain.hpo.api import create_app
from hybridtrain.hpo.experiments import ExperimentStore
from tests.hpo.conftest import serve_process, wait_for

pytestmark = pytest.mark.timeout(180)
TOKEN = "t" * 32
AUTH = (b"authorization", b"Bearer " + TOKEN.encode())
CHUNK = b"x" * 65536


def _call(app: Any, headers: list[tuple[bytes, bytes]], chunks: int,
          path: str = "/v1/experiments") -> tuple[int, str, int]:
    """POST to the ASGI app directly with a body of ``chunks`` chunks of 64 KiB.

    Returns:
        ``(status, detail, chunks the app read)``.
    """
    read = 0

    async def receive() -> dict[str, Any]:
        nonlocal read
        read += 1
        if read > chunks:
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": CHUNK, "more_body": read < chunks}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "root_path": "", "query_string": b"", "headers": headers,
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1)}
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body)["detail"], read


@pytest.fixture
def app(sqlite_url: str) -> Any:
    return create_app(ExperimentStore(sqlite_url), TOKEN, launcher=None, dashboard=False)


def test_unauthenticated_body_is_never_read(app: Any) -> None:
    huge = [(b"content-type", b"application/json"), (b"content-length", b"400000000")]
    for headers in (huge, [*huge, (b"authorization", b"Bearer wrong")]):
        status, detail, read = _call(app, headers, chunks=6000)
        assert (status, detail, read) == (401, "missing or invalid bearer token", 0)


def test_body_over_the_limit_is_413_before_parsing(app: Any) -> None:
    # Announced: refused from the header, nothing read.
    status, detail, read = _call(app, [AUTH, (b"content-length", b"400000000")], chunks=6000)
    assert (status, read) == (413, 0)
    assert detail == ("request body too large: at most 1048576 bytes are accepted; "
                      "got 400000000 bytes")
    # Streamed without a length: reading stops right after the limit (16 chunks of 64 KiB).
    status, detail, read = _call(app, [AUTH], chunks=6000)
    assert (status, read) == (413, 17)
    assert detail.startswith("request body too large: at most 1048576 bytes")


def test_body_within_the_limit_reaches_the_route(sqlite_url: str, make_spec: Any) -> None:
    client = TestClient(create_app(ExperimentStore(sqlite_url), TOKEN, launcher=None,
                                   dashboard=False, max_body=4096))
    headers = {"Authorization": f"Bearer {TOKEN}"}
    assert client.post("/v1/experiments", json=make_spec(), headers=headers).status_code == 201
    padded = make_spec(name="other") | {"padding": "x" * 5000}
    r = client.post("/v1/experiments", json=padded, headers=headers)
    assert r.status_code == 413 and r.json()["detail"].startswith("request body too large")
    assert [e["name"] for e in client.get("/v1/experiments", headers=headers).json()] == \
        ["branin"]  # the refused one stored nothing


def _children(pid: int) -> list[tuple[int, str]]:
    """``(pid, state)`` of the child processes of ``pid`` (Linux ``/proc``)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[1]) == pid:
            out.append((int(stat.parent.name), fields[0]))
    return out


def test_real_server_refuses_early_and_reaps_workers(tmp_path: Path, sqlite_url: str,
                                                     make_spec: Any) -> None:
    with serve_process(tmp_path, sqlite_url, token=TOKEN) as (server, base, _):
        url = urlsplit(base)
        # Unauthenticated 400 MB upload: answered 401 after the headers, body unread.
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
        conn.putrequest("POST", "/v1/experiments")
        conn.putheader("Content-Length", "400000000")
        conn.endheaders()
        conn.send(CHUNK)
        response = conn.getresponse()
        assert response.status == 401
        conn.close()

        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        spec = json.dumps(make_spec(max_trials=2))
        conn.request("POST", "/v1/experiments", spec, {
            "Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        assert conn.getresponse().status == 201
        conn.close()
        store = ExperimentStore(sqlite_url)
        wait_for(lambda: store.status("branin")["state"] == "succeeded", 120,
                 "the worker to finish the experiment")
        # The finished worker is reaped: no child of the server is left, zombie or not.
        wait_for(lambda: not _children(server.pid), 30, "the worker to be reaped")
