"""The launcher: torchrun argument mapping, a failing rank's exit code and name, and
``hybridtrain train --nproc-per-node``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridtrain.parallel.launch import LaunchSpec, torchrun_argv

FAILING_SCRIPT = """
import sys
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    sys.exit(3)
dist.barrier()  # rank 0 waits here for a peer that is gone: the launcher must stop it
"""


def test_torchrun_argv_maps_each_rendezvous() -> None:
    assert torchrun_argv(LaunchSpec(nproc_per_node="2"), "s.py", ["--x"]) == [
        "--nproc-per-node=2", "--nnodes=1", "--max-restarts=0", "--standalone", "s.py", "--x"]
    static = torchrun_argv(LaunchSpec(nnodes="2", node_rank=1, master_addr="10.0.0.1", master_port=29400), "s.py", [])
    assert "--node-rank=1" in static and "--master-addr=10.0.0.1" in static and "--master-port=29400" in static
    elastic = torchrun_argv(LaunchSpec(nnodes="1:4", rdzv_endpoint="h:29400", max_restarts=3, module=True), "m", [])
    assert {"--rdzv-backend=c10d", "--rdzv-endpoint=h:29400", "--max-restarts=3", "--module"} <= set(elastic)


@pytest.mark.parametrize(("spec", "needle"), [
    (LaunchSpec(nnodes="2"), "needs --rdzv-endpoint"),
    (LaunchSpec(rdzv_endpoint="h:1", master_addr="h"), "not both"),
    (LaunchSpec(max_restarts=-1), "--max-restarts -1"),
])
def test_contradictory_options_are_refused(spec: LaunchSpec, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        spec.validate()


@pytest.mark.timeout(120)
def test_a_dying_rank_fails_the_launch_naming_it(tmp_path: Path) -> None:
    script = tmp_path / "die.py"
    script.write_text(FAILING_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "hybridtrain.parallel.launch_cli", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "error: rank 1 (local rank 1" in proc.stderr and "exited with code 3" in proc.stderr


@pytest.mark.timeout(180)
def test_train_with_nproc_per_node_writes_once(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "hybridtrain.cli", "train", "--nproc-per-node", "2", "--steps", "2",
         "--output-dir", str(out), "--no-progress", "--set", "model.overrides.n_layer=1",
         "--set", "data.seq_len=32", "--set", "train_micro_batch_size_per_gpu=2"],
        capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("summary:") == 1  # rank 0 alone reports
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [1, 2]  # one writer: no duplicate records
    assert (out / "checkpoints" / "step-0000002" / "meta.json").exists()
