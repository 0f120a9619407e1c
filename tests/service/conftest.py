"""Fixtures of the training-service tests: a storage, a tiny training config, helpers."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("optuna")
pytest.importorskip("fastapi")

# The HPO tests' experiment spec and storage fixtures, for trials run as jobs.
from tests.hpo.conftest import make_spec, sqlite_url  # noqa: E402, F401
from tests.service.serving import REPO, TOKEN, serving  # noqa: E402, F401 - REPO and TOKEN for the tests

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def storage(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'service.db'}"


def api_client(storage: str, jobs_dir: Path, slots: str = "cpu:2", raise_server_exceptions: bool = True) -> Any:
    """A test client of the service's REST app over ``storage`` (no dashboard), with the
    service on ``app.state.service``."""
    from fastapi.testclient import TestClient

    from hybridtrain.commands.serve import build_app
    from hybridtrain.service.devices import parse_slots
    from hybridtrain.service.opening import make_backends, open_service

    parsed = parse_slots(slots)
    service = open_service(storage, jobs_dir, None, make_backends(parsed), parsed)
    app = build_app(service, TOKEN, dashboard=False)
    app.state.service = service
    return TestClient(app, raise_server_exceptions=raise_server_exceptions)


def tiny_config(path: Path, steps: int, checkpoint_every: int) -> Path:
    """A one-layer GPT training config: a few seconds of CPU training."""
    path.write_text(
        "device: cpu\n"
        "model: {name: gpt-tiny, overrides: {n_layer: 1}}\n"
        "data: {seq_len: 16}\n"
        "train_batch_size: 4\n"
        f"train: {{steps: {steps}, checkpoint_every: {checkpoint_every}, eval_every: 0}}\n")
    return path


SLACK = 4
"""How many times its stated timeout :func:`wait_for` waits."""


def wait_for(predicate: Callable[[], bool], timeout: float, what: str,
             tick: Callable[[], object] | None = None) -> None:
    """Poll ``predicate`` (ticking ``tick`` between polls); fail after ``timeout`` s times
    :data:`SLACK` (the suite runs on two pytest workers over as many cores, so processes the
    service starts and stops run slower than alone; a wait that passes costs no more)."""
    timeout *= SLACK
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tick is not None:
            tick()
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def group_members(pgid: int) -> list[int]:
    """Pids of the process group ``pgid`` other than its leader."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == pgid:
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            out.append(int(entry.name))
    return out


def kill_members(pgid: int) -> None:
    """SIGKILL the job's own processes, not its wrapper: a rank killed under it."""
    for pid in group_members(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A real ``hybridtrain serve --port 0`` on one CPU slot: what it printed, by label
    (``"jobs page"``: the page address...), once it answers."""
    with serving(tmp_path) as printed:
        yield printed
