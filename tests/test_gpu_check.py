"""``scripts/gpu_check.sh --dry-run``: every part of the GPU check runs at toy sizes on the
CPU, so the script a GPU window depends on cannot rot; and a part the budget cannot fit
leaves a row saying so instead of running past the window."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("cuda_tests", "modes", "clip_overlap", "host_adam", "depth", "big", "big64k", "deepspeed", "deepspeed_6p7b")
MODES = ["plain", "checkpointing", "activation_swap", "optimizer_offload", "layer_streaming", "layer_major"]


def _check(tmp_path: Path, *args: str, budget: int | None = None, extra: dict[str, str] | None = None) -> list[dict]:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, **(extra or {})}
    if budget is not None:
        env["GPU_CHECK_BUDGET_S"] = str(budget)
    done = subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in (tmp_path / "gpu_results.jsonl").read_text().splitlines()]


def test_dry_run_runs_every_part_and_writes_its_rows(tmp_path: Path) -> None:
    rows = _check(tmp_path, "--dry-run")
    env = rows[0]
    assert env["part"] == "env" and env["dry_run"] is True and env["missing_modules"] == []
    done = {r["part"]: r for r in rows if "status" in r and "rc" in r}
    assert {p: r["status"] for p, r in done.items()} == {p: "done" for p in PARTS}
    tests = [r for r in rows if r["part"] == "cuda_tests" and "test" in r]
    assert len(tests) >= 10 and all(r["outcome"] == "skipped" for r in tests)  # no CUDA here
    assert any("stream_races" in r["test"] for r in tests)
    measured = {r["name"]: r for r in rows if r["part"] == "modes" and "name" in r}
    assert list(measured) == [*MODES, "fsdp2_cpu_offload"]
    assert all(r["status"] == "ok" and r["tokens_per_step"] == 2 * 2 * 64 for r in measured.values())
    moved = {name: measured[name]["transfer_bytes"] for name in MODES}
    assert moved["plain"] == dict.fromkeys(moved["plain"], 0)
    assert moved["activation_swap"]["activations_out"] == moved["activation_swap"]["activations_in"] > 0
    assert moved["optimizer_offload"]["gradients_down"] > 0 and moved["layer_major"]["weights_up"] > 0
    clipped = [(r["name"], r["overlap"]) for r in rows if r["part"] == "clip_overlap" and r.get("kind") == "mode"
               and r["status"] == "ok" and r["clip"] == 1.0]
    assert clipped == [(name, overlap) for overlap in (False, True)
                       for name in ("optimizer_offload", "layer_streaming", "layer_major")]
    (adam,) = [r for r in rows if r["part"] == "host_optimizer"]
    assert adam["name"] == "torch_fused" and adam["gparams_s"] > 0
    assert all(r["planned_step_s"] > 0 and r["planned_peak_gib"] > 0 for r in measured.values()
               if r["name"] != "fsdp2_cpu_offload")
    depths = {r["name"]: r for r in rows if r["part"] == "depth" and r.get("kind") == "depth"}
    assert list(depths) == ["plain", "layer_major"]
    assert all(d["n_layer"] >= 1 and d["predicted_n_layer"] >= 1 for d in depths.values())
    big, kept = [r for r in rows if r["part"] == "big" and r.get("kind") == "mode"]
    assert (big["name"], kept["name"]) == ("layer_major", "layer_major_kept")
    assert all(r["status"] == "ok" and r["n_layer"] == 3 and r["clip"] == 1.0 for r in (big, kept))
    # Kept blocks cross once per step: fewer weight bytes up than uploading them again.
    assert kept["transfer_bytes"]["weights_up"] < big["transfer_bytes"]["weights_up"]
    (big64k,) = [r for r in rows if r["part"] == "big64k" and r.get("kind") == "mode"]
    assert big64k["name"] == "layer_major_kept" and big64k["status"] == "ok"
    assert big64k["tokens_per_step"] == 2 * big["tokens_per_step"]
    ours = {r["name"]: r["status"] for r in rows if r["part"] == "deepspeed" and r.get("kind") == "mode"}
    assert ours == {"optimizer_offload": "ok", "layer_major": "ok"}
    incumbents = {r["name"]: r["status"] for r in rows if r["part"] == "deepspeed" and r.get("kind") == "baseline"}
    assert set(incumbents) == {"deepspeed_zero_offload", "deepspeed_zero3_offload"}  # on the CPU: why not
    headline = {r["name"]: r["kind"] for r in rows if r["part"] == "deepspeed_6p7b" and "kind" in r}
    assert headline == {"layer_major": "mode", "deepspeed_zero3_offload": "baseline"}


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
