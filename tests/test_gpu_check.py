"""``scripts/gpu_check.sh --dry-run``: every part of the GPU check runs at toy sizes on the
CPU, so the script a GPU window depends on cannot rot; and a part the budget cannot fit
leaves a row saying so instead of running past the window."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("cuda_tests", "link", "width", "big", "big64k", "modes", "clip_overlap", "host_adam", "depth")
MODES = ["plain", "checkpointing", "activation_swap", "optimizer_offload", "layer_streaming", "layer_major"]
OURS_WITH_TIMELINE = {"activation_swap", "optimizer_offload", "layer_streaming", "layer_major", "layer_major_kept",
                      "twin_flow_first"}
DEEPSPEED = ("deepspeed_zero_offload", "deepspeed_zero3_offload", "deepspeed_super_offload")
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _check(tmp_path: Path, *args: str, budget: int | None = None, extra: dict[str, str] | None = None) -> list[dict]:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, **(extra or {})}
    if budget is not None:
        env["GPU_CHECK_BUDGET_S"] = str(budget)
    done = subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=850)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in (tmp_path / "gpu_results.jsonl").read_text().splitlines()]


def _peers_ran(rows: list[dict], part: str, names: tuple[str, ...]) -> None:
    """Every peer of ``part`` ran >= 3 timed steps with its exact settings, or says why not:
    DeepSpeed where it is not installed, SuperOffload (CUDA only) on the CPU."""
    peers = {r["name"]: r for r in rows if r["part"] == part and r.get("kind") == "baseline"}
    assert list(peers) == list(names)
    for name, row in peers.items():
        assert row["config"], name  # the settings it ran with (or would have)
        if name == "deepspeed_super_offload" or (name.startswith("deepspeed") and not HAS_DEEPSPEED):
            assert row["status"] == "skipped" and row["reason"], name
            assert HAS_DEEPSPEED or row["reason"] == "deepspeed not installed"
        else:
            assert row["status"] == "ok" and row["steps_timed"] >= 3, (name, row["status"])
            assert row["step_s_min"] <= row["step_s_median"]
    zero_offload = peers.get("deepspeed_zero_offload")
    if zero_offload is not None:
        zero = zero_offload["config"]["zero_optimization"]
        assert zero_offload["config"]["gradient_accumulation_steps"] == 1  # DeepSpeed's fast path
        assert zero["overlap_comm"] and zero["contiguous_gradients"] and zero["reduce_scatter"]
        assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}


@pytest.mark.timeout(900)  # on a fresh machine it also compiles DeepSpeed's two CPU ops (~2 minutes on 2 cores)
def test_dry_run_runs_every_part_and_writes_its_rows(tmp_path: Path) -> None:
    rows = _check(tmp_path, "--dry-run")
    env = rows[0]
    assert env["part"] == "env" and env["dry_run"] is True and env["missing_modules"] == []
    done = {r["part"]: r for r in rows if "status" in r and "rc" in r}
    assert {p: r["status"] for p, r in done.items()} == {p: "done" for p in PARTS}
    assert [r["part"] for r in rows if "rc" in r] == list(PARTS)  # the order worth device time
    tests = [r for r in rows if r["part"] == "cuda_tests" and "test" in r]
    assert len(tests) >= 10 and all(r["outcome"] == "skipped" for r in tests)  # no CUDA here
    assert any("stream_races" in r["test"] for r in tests)
    (link,) = [r for r in rows if r["part"] == "link" and "h2d_gb_s" in r]
    assert link["status"] == "ok" and min(link["h2d_gb_s"], link["d2h_gb_s"], link["bidir_gb_s"]) > 0
    ours = [r for r in rows if r.get("kind") == "mode"]
    assert ours and all(r["status"] == "ok" and r["steps_timed"] >= 3 and r["bind"] for r in ours)
    for row in ours:  # a measured timeline on every offload and streaming row, from the same code as on a GPU
        assert (row["timeline"] is not None) == (row["name"] in OURS_WITH_TIMELINE), row["name"]
        if row["timeline"]:
            assert row["timeline"]["source"] == "wall clock" and row["timeline"]["total"] > 0
    timelines = {r["name"]: r["timeline"] for r in ours if r["part"] == "modes" and r["timeline"]}
    assert timelines["optimizer_offload"]["host_step"] > 0 and timelines["optimizer_offload"]["downloads"] > 0
    assert timelines["activation_swap"]["recomputation"] > 0 and timelines["layer_major"]["uploads"] > 0
    measured = {r["name"]: r for r in ours if r["part"] == "modes"}
    assert list(measured) == MODES
    assert all(r["tokens_per_step"] == 2 * 2 * 64 for r in measured.values())
    moved = {name: measured[name]["transfer_bytes"] for name in MODES}
    assert moved["plain"] == dict.fromkeys(moved["plain"], 0)
    assert moved["activation_swap"]["activations_out"] == moved["activation_swap"]["activations_in"] > 0
    assert moved["optimizer_offload"]["gradients_down"] > 0 and moved["layer_major"]["weights_up"] > 0
    assert all(r["planned_step_s"] > 0 and r["planned_peak_gib"] > 0 for r in measured.values())
    _peers_ran(rows, "modes", ("fsdp2_cpu_offload", *DEEPSPEED))
    _peers_ran(rows, "big", DEEPSPEED)
    (wide,) = [r for r in ours if r["part"] == "width"]
    assert (wide["name"], wide["n_layer"]) == ("plain", 2) and wide["step_s"] > 0
    big, planned = [r for r in ours if r["part"] == "big"]
    assert (big["name"], big["n_layer"], big["clip"]) == ("layer_major_kept", 3, 1.0)
    assert (planned["name"], planned["clip"]) == ("twin_flow_first", 1.0) and planned["planned_step_s"] > 0
    big_peers = [r for r in rows if r["part"] == "big" and r.get("kind") == "baseline"]
    assert all(r["config"]["activation_checkpointing"].startswith("every block") for r in big_peers)
    (big64k,) = [r for r in ours if r["part"] == "big64k"]
    assert big64k["name"] == "layer_major_kept" and big64k["tokens_per_step"] == 2 * big["tokens_per_step"]
    clipped = [(r["name"], r["overlap"]) for r in ours if r["part"] == "clip_overlap" and r["clip"] == 1.0]
    assert clipped == [(name, overlap) for overlap in (False, True)
                       for name in ("optimizer_offload", "layer_streaming", "layer_major")]
    (adam,) = [r for r in rows if r["part"] == "host_optimizer"]
    assert adam["name"] == "torch_fused" and adam["gparams_s"] > 0
    depths = {r["name"]: r for r in rows if r["part"] == "depth" and r.get("kind") == "depth"}
    assert list(depths) == ["plain", "layer_major"]
    assert all(d["n_layer"] >= 1 and d["predicted_n_layer"] >= 1 for d in depths.values())


def test_a_follow_up_call_skips_the_parts_done(tmp_path: Path) -> None:
    env = {"GPU_CHECK_PARTS": "host_adam"}
    _check(tmp_path, "--dry-run", extra=env)
    rows = _check(tmp_path, "--dry-run", extra={**env, "GPU_CHECK_RESUME": "1"})
    assert [r["part"] for r in rows] == ["env", "host_optimizer", "host_adam", "env"]


def test_parts_the_budget_cannot_fit_are_skipped_with_a_row(tmp_path: Path) -> None:
    rows = _check(tmp_path, "--dry-run", budget=5)
    skipped = {r["part"] for r in rows if r.get("status") == "skipped"}
    assert skipped == set(PARTS)


def test_unknown_argument_is_one_line(tmp_path: Path) -> None:
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--fast"], cwd=ROOT, capture_output=True, text=True,
                          timeout=30, env={**os.environ, "OUT": str(tmp_path)})
    assert done.returncode == 2 and done.stderr.strip() == "usage: scripts/gpu_check.sh [--dry-run]"
