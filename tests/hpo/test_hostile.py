"""The HPO service survives anything a trial prints or a spec holds, and any client:
one parametrized test per class of hostile input (issue #25's probe, kept in the suite)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from hybridtrain.hpo.api import create_app
from hybridtrain.hpo.errors import SpecError
from hybridtrain.hpo.experiments import ExperimentStore, run_experiment
from hybridtrain.hpo.leases import Leases
from hybridtrain.hpo.metrics import MetricsCollector
from hybridtrain.hpo.spec import load_spec
from tests.hpo.conftest import PY, free_port

pytestmark = pytest.mark.timeout(120)
TOKEN = "t" * 32
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DEEP = "[" * 100_000 + "]" * 100_000

BAD_LINES = [
    ("stdout", "step=-1 loss=1.0"),
    ("stdout", f"step={2**63} loss=1.0"),
    ("stdout", "step=1e30 loss=1.0"),
    ("jsonl", json.dumps({"step": -1, "loss": 1.0})),
    ("jsonl", json.dumps({"step": 2**64, "loss": 1.0})),
    ("jsonl", '{"step": 1, "loss": ' + DEEP + "}"),
    ("jsonl", '{"step": 1, "loss": 1' + "0" * 400 + "}"),
]


@pytest.mark.parametrize(("where", "line"), BAD_LINES, ids=[f"{w}:{ln[:24]}" for w, ln in BAD_LINES])
def test_bad_metric_lines_are_counted_and_skipped_with_one_warning(
        tmp_path: Path, where: str, line: str, caplog: pytest.LogCaptureFixture) -> None:
    stdout, jsonl = tmp_path / "stdout.log", tmp_path / "metrics.jsonl"
    target = stdout if where == "stdout" else jsonl
    good = "step=2 loss=0.5" if where == "stdout" else json.dumps({"step": 2, "loss": 0.5})
    target.write_text(f"{line}\n{line}\n{good}\n")
    collector = MetricsCollector(stdout, jsonl)
    with caplog.at_level(logging.WARNING, logger="hybridtrain.hpo.metrics"):
        new = collector.poll(final=True)
    assert [(o.metric, o.value, o.step) for o in new] == [("loss", 0.5, 2)]
    assert collector.bad_lines == 2
    assert len(caplog.records) == 1 and "skipped a metrics line" in caplog.records[0].getMessage()


def test_a_trial_printing_every_bad_line_still_completes_its_experiment(
        tmp_path: Path, make_spec: Any, sqlite_url: str) -> None:
    script = tmp_path / "hostile_trial.py"
    lines = [ln for w, ln in BAD_LINES if w == "jsonl"]
    script.write_text(
        "import json, os, sys\n"
        f"bad = {lines!r}\n"
        "with open(os.environ['HYBRIDTRAIN_METRICS_FILE'], 'a') as f:\n"
        "    for line in bad: f.write(line + '\\n')\n"
        "print('step=-1 loss=9'); print('step=%d loss=9' % 2**63)\n"
        "print('step=1 loss=%s' % (float(sys.argv[1]) ** 2))\n")
    spec = make_spec(name="hostile", max_trials=2, parallel_trials=1,
                     trial={"command": f"{PY} -S {script} ${{x1}}"})
    status = run_experiment(spec, sqlite_url)
    assert status["state"] == "succeeded" and status["trials"]["complete"] == 2
    trials = ExperimentStore(sqlite_url).study("hostile").get_trials()
    assert all(t.user_attrs["bad_metric_lines"] == len(lines) + 2 for t in trials)


@pytest.mark.parametrize(("path", "value", "field"), [
    (("trial", "env"), {"A=B": "1"}, "trial.env.A=B"),
    (("trial", "env"), {"A\0": "1"}, "trial.env.A\\u0000"),
    (("trial", "env"), {"": "1"}, "trial.env."),
    (("trial", "env"), {"OK": "a\0b"}, "trial.env.OK"),
    (("trial", "command"), "echo \0", "trial.command"),
    (("trial", "workdir"), ".\0", "trial.workdir"),
    (("output_dir",), "runs\0", "output_dir"),
])
def test_a_spec_the_os_cannot_run_is_refused_in_one_line(make_spec: Any, path: tuple[str, ...], value: Any,
                                                         field: str) -> None:
    spec = make_spec()
    node = spec
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(SpecError) as err:
        load_spec(spec)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"invalid experiment spec: field '{field}'")


def test_reposting_a_name_with_another_spec_is_a_conflict(sqlite_url: str, make_spec: Any) -> None:
    client = TestClient(create_app(ExperimentStore(sqlite_url), TOKEN, launcher=None, dashboard=False))
    spec = make_spec()
    assert client.post("/v1/experiments", json=spec, headers=AUTH).status_code == 201
    assert client.post("/v1/experiments", json=spec, headers=AUTH).status_code == 201  # the same: fine
    other = make_spec(trial={"command": "echo loss=1"})
    r = client.post("/v1/experiments", json=other, headers=AUTH)
    assert r.status_code == 409 and "trial.command" in r.json()["detail"]


def test_a_dead_worker_fails_its_experiment_and_stop_always_ends(
        sqlite_url: str, make_spec: Any, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from hybridtrain.commands import hpo as cli
    from hybridtrain.hpo.controller import Controller

    store = ExperimentStore(sqlite_url)
    spec = load_spec(make_spec(name="dies"))
    store.create(spec)

    def crash(self: Controller, **_: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(Controller, "run", crash)
    assert cli.main(["worker", "dies", "--storage", sqlite_url]) == 1
    assert capsys.readouterr().err.strip().endswith("died: RuntimeError: boom")
    status = store.status("dies")
    assert status["state"] == "failed" and "RuntimeError: boom" in status["reason"]

    # A controller that claimed a slot and died (its lease expired): stop still ends.
    spec = load_spec(make_spec(name="orphan"))
    store.create(spec)
    assert Leases(store.records.engine, "orphan", "ghost", 0.05).claim(allow_pending=True) is not None
    time.sleep(0.1)
    assert store.stop("orphan")["state"] == "stopped"


@pytest.fixture
def guarded_server(sqlite_url: str) -> Iterator[tuple[str, int]]:
    """The REST app in a real uvicorn server with ``hpo serve``'s guard (short bounds)."""
    import uvicorn

    from hybridtrain.server.slow_clients import guarded_protocol

    port = free_port()
    app = create_app(ExperimentStore(sqlite_url), TOKEN, launcher=None, dashboard=False)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                                           http=guarded_protocol(request_timeout=1.5, per_client=16)))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield "127.0.0.1", port
    server.should_exit = True
    thread.join(10)


def test_slow_clients_cannot_starve_the_server(guarded_server: tuple[str, int]) -> None:
    host, port = guarded_server
    slow: list[socket.socket] = []
    for _ in range(100):  # slowloris: headers begun, never finished, no token
        sock = socket.create_connection((host, port), timeout=5)
        sock.sendall(b"POST /v1/experiments HTTP/1.1\r\nHost: x\r\n")
        slow.append(sock)
    started = time.monotonic()
    answered = 0
    while time.monotonic() - started < 2.5:  # past the request timeout
        for sock in slow:
            with contextlib.suppress(OSError):  # one more header now and then keeps none alive
                sock.sendall(b"X-a: b\r\n")
        with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=2) as r:
            answered += r.status == 200
        time.sleep(0.25)
    assert answered >= 5
    closed = 0
    for sock in slow:
        try:
            sock.settimeout(2)
            closed += sock.recv(1024) == b""
        except OSError:
            closed += 1
        sock.close()
    assert closed == 100  # every slow connection was cut: by the per-client bound or the timeout
