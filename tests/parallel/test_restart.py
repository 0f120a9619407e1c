"""Restarts resume by themselves: ``kill -9`` of a worker under ``--max-restarts 1`` → the
group restarts (on a fresh rendezvous round, see ``mesh.restart_store``) → every rank
continues from the newest checkpoint, and the losses equal an uninterrupted run's bit for
bit. Two cycles of ``scripts/restart_soak.py`` (docs/results.md's figure is its 20-cycle run)."""

from __future__ import annotations

import importlib.util
import sys
from datetime import timedelta
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _soak():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("restart_soak", ROOT / "scripts" / "restart_soak.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(400)
def test_a_killed_rank_restarts_and_resumes_exactly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A kill inside a step (its gradient all-reduce) and one while a checkpoint is written.
    code = _soak().main(["--cycles", "2", "--steps", "4", "--moments", "step,checkpoint", "--timeout", "150",
                         "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "resumed exactly: 2/2" in out, out + "".join(
        p.read_text()[-3000:] for p in tmp_path.glob("cycle-*/launcher.log"))


def test_each_restart_round_sees_only_its_own_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from hybridtrain.parallel.mesh import restart_store
    from tests.parallel.spawn import free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 1, is_master=True)  # the agent's, shared by every round
    server.set("default_pg/0//cpu//rank_0", "address of a dead rank")  # as round 0 left it
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    store = restart_store(timedelta(seconds=5))
    assert store is not None and not store.check(["default_pg/0//cpu//rank_0"])
    store.set("x", "1")
    assert server.check(["hybridtrain/restart-1/x"])
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")  # several agents count restarts apart: no common prefix
    assert restart_store(timedelta(seconds=5)) is None
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # env:// makes a fresh store itself
    assert restart_store(timedelta(seconds=5)) is None
