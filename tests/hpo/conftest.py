"""Fixtures of the HPO tests: fast synthetic trials, storages, a throwaway PostgreSQL."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("optuna")

REPO = Path(__file__).resolve().parents[2]
BRANIN = REPO / "examples" / "hpo" / "branin.py"
PY = sys.executable


def branin_command(steps: int = 1, sleep: float = 0.0) -> str:
    """Trial command running the Branin example with the spec's x1/x2."""
    # -S: the example needs only the standard library, and skipping site (the venv's
    # .pth files) makes every trial start several times faster on a loaded machine.
    return f"{PY} -S {BRANIN} ${{x1}} ${{x2}} --steps {steps} --sleep {sleep}"


@pytest.fixture
def make_spec(tmp_path: Path) -> Callable[..., dict[str, Any]]:
    """Build a small Branin experiment spec dict; keyword arguments override fields."""

    def make(**overrides: Any) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "name": "branin",
            "objective": {"metric": "loss", "direction": "minimize"},
            "parameters": {
                "x1": {"type": "float", "low": -5.0, "high": 10.0},
                "x2": {"type": "float", "low": 0.0, "high": 15.0},
            },
            "algorithm": {"name": "tpe", "seed": 0, "n_startup_trials": 3},
            "trial": {"command": branin_command(), "kill_grace": 2.0},
            "parallel_trials": 2,
            "max_trials": 6,
            "max_failed_trials": 2,
            # Short enough for a quick kill -9 resume, long enough that a heartbeat
            # delayed by a loaded machine does not lose a lease.
            "durability": {"heartbeat_interval": 0.25, "lease_duration": 2.5,
                           "poll_interval": 0.05},
            "output_dir": str(tmp_path / "runs"),
        }
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(spec.get(key), dict):
                spec[key] = spec[key] | value
            else:
                spec[key] = value
        return spec

    return make


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'hpo.db'}"


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pg_bin() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if found:
        return found[-1].parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A PostgreSQL server in a temporary directory, started for this test session.

    Skips (saying why) only when no server can be started: binaries missing, or no
    unprivileged user to run them as root.
    """
    pytest.importorskip("psycopg2")
    bindir = _pg_bin()
    if bindir is None:
        pytest.skip("PostgreSQL server binaries not found (install postgresql; .ci/postgres.sh)")
    run_as: list[str] = []
    if os.geteuid() == 0:
        # PostgreSQL refuses to run as root.
        if subprocess.run(["id", "postgres"], capture_output=True).returncode != 0:
            pytest.skip("running as root and no 'postgres' user to run PostgreSQL as")
        # runuser lives in /usr/sbin, which a minimal PATH (a newcomer's shell) leaves out.
        runuser = shutil.which("runuser", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
        if runuser is None:
            pytest.skip("running as root and no runuser to run PostgreSQL as the 'postgres' user")
        run_as = [runuser, "-u", "postgres", "--"]
    tmp = Path(tempfile.mkdtemp(prefix="hpo-pg-"))
    os.chmod(tmp, 0o777)
    data, port = tmp / "data", free_port()
    try:
        subprocess.run([*run_as, str(bindir / "initdb"), "-D", str(data), "-U", "hpo",
                        "--auth=trust", "-E", "UTF8"], check=True, capture_output=True,
                       timeout=120)
        subprocess.run([*run_as, str(bindir / "pg_ctl"), "-D", str(data), "-w", "-t", "60",
                        "-l", str(tmp / "log"), "-o",
                        f"-p {port} -k {tmp} -c listen_addresses=127.0.0.1", "start"],
                       check=True, capture_output=True, timeout=90)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        shutil.rmtree(tmp, ignore_errors=True)
        pytest.skip(f"PostgreSQL could not be started: {detail.decode(errors='replace')[-200:]}")
    url = f"postgresql://hpo@127.0.0.1:{port}/postgres"
    try:
        yield url
    finally:
        subprocess.run([*run_as, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate",
                        "stop"], capture_output=True, timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` until true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@contextmanager
def serve_process(tmp_path: Path, storage: str, token: str | None = None
                  ) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    """A real ``hpo serve`` on a free loopback port, answering ``/health``.

    Args:
        tmp_path: holds its token file (``token``) and output (``serve.log``).
        storage: its storage URL.
        token: ``$HYBRIDTRAIN_HPO_TOKEN`` for it; ``None``: unset, so it uses the file.

    Yields:
        ``(process, base URL, output file)``; the server is terminated afterwards.
    """
    out, port = tmp_path / "serve.log", free_port()
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDTRAIN_HPO_TOKEN"}
    if token is not None:
        env["HYBRIDTRAIN_HPO_TOKEN"] = token
    with out.open("wb") as log:
        proc = subprocess.Popen([PY, "-m", "hybridtrain.hpo", "serve", "--port", str(port),
                                 "--storage", storage, "--token-file",
                                 str(tmp_path / "token")], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: "REST API" in out.read_text() or proc.poll() is not None, 90,
                 "the server to start")
        wait_for(lambda: proc.poll() is not None or _answers(base), 60,
                 "the server to accept connections")
        assert proc.poll() is None, out.read_text()
        yield proc, base, out
    finally:
        proc.terminate()
        proc.wait(30)


def _answers(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/health", timeout=5):
            return True
    except OSError:
        return False
