"""The planner against every GPU row the project measured (benchmarks/results/*/): each of
our engine's rows is planned for its model, mode and machine, as the code that ran there
(full-width transfers, the host step not pipelined), and its measured step time and device
peak held against the prediction. The H100's kernel efficiency is derived from its plain row
again, so the table's figure cannot drift from the measurement it cites."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from hybridtrain.hardware.efficiency import H100_MEASURED, KernelEfficiency, kernel_efficiency
from hybridtrain.hardware.peaks import find_device
from hybridtrain.models.gpt import GPT, causal_lm_loss, gpt_config
from hybridtrain.planner.estimate import Estimate, Target, estimate, model_source

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
STEP_TOLERANCE = 0.20
"""Issue #39: every measured row's predicted step within ±20 %."""
PEAK_TOLERANCE = 0.10
"""docs/planning.md's goal for device memory: ±10 %."""
HOST_BANDWIDTH = 152.3e9
"""The H100 machine's in-place triad (the ``host_optimizer`` row of call 1)."""
UNEXPLAINED = {
    ("1.3b", "optimizer_offload"): "measured 1.43x the plan: 0.22 s more than compute plus the host work "
                                   "(update and micro-batch sums) left exposed after the last backward",
    ("1.3b", "layer_major"): "measured 1.59x the plan, which hides the host step behind the whole backward",
    ("6.7b", "layer_major"): "measured 1.22x the plan: as the 1.3B layer-major row, 0.42 s instead of 0.25 s",
}
"""Rows outside ±20 % whose wrong term is not yet found (docs/planning.md says why): the test
asserts they are still outside, so a fix of the model moves them out of this list."""


def _benchmark() -> ModuleType:
    """benchmarks/offload.py: the configuration each mode ran with."""
    path = ROOT / "benchmarks" / "offload.py"
    spec = importlib.util.spec_from_file_location("offload_benchmark", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def measured_rows() -> list[dict[str, Any]]:
    """Our engine's timed rows on a GPU, each with its machine's ``env`` row, deduplicated
    by (size, mode) keeping the last (later calls re-ran disturbed parts cleanly)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(RESULTS.glob("*/*.jsonl")):
        env: dict[str, Any] | None = None
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row.get("part") == "env":
                env = row
            elif (row.get("kind") == "mode" and row.get("status") == "ok" and row.get("device") == "cuda"
                  and env is not None and not env.get("dry_run")):
                rows[(row["size"], row["name"])] = {**row, "env": env, "file": path.name}
    return list(rows.values())


def planned(bench: ModuleType, row: dict[str, Any]) -> Estimate:
    """The planner's estimate of ``row`` on its machine, as the code that ran there."""
    tokens = row["tokens_per_step"]
    setup = bench.Setup(gpt_config(row["size"], seq_len=1024, n_layer=row["n_layer"]), 8, tokens // (8 * 1024), 1,
                        "cuda")
    spec = find_device(row["env"]["device"])
    assert spec is not None, row["env"]["device"]
    target = Target("cuda", spec.name, int(row["env"]["device_memory_gib"] * 2**30),
                    int(row["env"]["host_memory_gib"] * 2**30), HOST_BANDWIDTH)
    with torch.device("meta"):
        model = GPT(setup.model)
    example = tuple(t[:setup.batch].to("meta") for t in setup.example())
    return estimate(bench.engine_config(setup, row["name"]), target, half_width=False, pipelined_host_step=False,
                    model=model_source(model, example, causal_lm_loss))


@pytest.fixture(scope="module")
def predictions() -> list[tuple[dict[str, Any], Estimate]]:
    bench = _benchmark()
    return [(row, planned(bench, row)) for row in measured_rows()]


def test_every_measured_gpu_row_is_planned(predictions: list[tuple[dict[str, Any], Estimate]]) -> None:
    names = {(row["size"], row["name"]) for row, _ in predictions}
    assert {("1.3b", "plain"), ("1.3b", "optimizer_offload"), ("6.7b", "layer_major")} <= names
    # Call 3's clean rerun replaces call 1's row disturbed by DeepSpeed's background build.
    offload = next(row for row, _ in predictions if row["name"] == "optimizer_offload")
    assert offload["file"].startswith("call3")


def test_predicted_step_within_20_percent_of_each_measured_row(
        predictions: list[tuple[dict[str, Any], Estimate]]) -> None:
    for row, est in predictions:
        ratio = row["step_s"] / est.step_seconds
        key = (row["size"], row["name"])
        within = abs(ratio - 1) <= STEP_TOLERANCE
        if key in UNEXPLAINED:
            assert not within, f"{key} is now within ±20 % ({ratio:.2f}): take it off UNEXPLAINED"
        else:
            assert within, f"{key}: measured {row['step_s']:.3f} s, planned {est.step_seconds:.3f} s ({ratio:.2f})"


def test_predicted_device_peak_within_10_percent_of_each_measured_row(
        predictions: list[tuple[dict[str, Any], Estimate]]) -> None:
    for row, est in predictions:
        planned_gib = est.device_peak_bytes / 2**30
        assert row["peak_gib"] == pytest.approx(planned_gib, rel=PEAK_TOLERANCE), (row["size"], row["name"])


def test_the_h100_efficiency_is_what_its_plain_row_measured(
        predictions: list[tuple[dict[str, Any], Estimate]], monkeypatch: pytest.MonkeyPatch) -> None:
    row, est = next((r, e) for r, e in predictions if (r["size"], r["name"]) == ("1.3b", "plain"))
    assert kernel_efficiency(est.target.name) == H100_MEASURED
    # The compute time is FLOPs ÷ (peak × share) + launches: planned again at twice the share,
    # the difference is half the FLOPs' seconds, and what is left of compute the launches.
    doubled = KernelEfficiency(2 * H100_MEASURED.share, "test")
    # (the package's ``estimate`` function shadows its module's name: patch the module itself)
    monkeypatch.setattr(sys.modules[Estimate.__module__], "kernel_efficiency", lambda name: doubled)
    faster = planned(_benchmark(), row)
    flops_seconds = 2 * (est.time.compute - faster.time.compute)
    launches = est.time.compute - flops_seconds
    assert 0 < launches < 0.1 * est.time.compute
    measured_share = H100_MEASURED.share * flops_seconds / (row["step_s"] - est.time.optimizer - launches)
    assert measured_share == pytest.approx(H100_MEASURED.share, abs=0.005)
