"""The offload and host-optimizer benchmarks run end to end on tiny sizes (CPU), isolate a
failing configuration, release its memory, and stop the depth search at the host limit."""

from __future__ import annotations

import functools
import gc
import importlib.util
import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hybridtrain.models.gpt import GPT, causal_lm_loss, gpt_config, gpt_param_count
from hybridtrain.runtime.transfer import HostMemoryError

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--size", "tiny", "--n-layer", "2", "--seq-len", "16", "--batch", "2", "--accumulation", "2",
        "--steps", "1", "--device", "cpu"]
ROW_KEYS = {"name", "step_s", "tokens_s", "tflops", "mfu", "peak_gib", "params", "status"}


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


offload = _load("offload")
cpu_adam = _load("cpu_adam")


@pytest.fixture(autouse=True)
def _no_process_group_left() -> Iterator[None]:
    """FSDP2 joins a one-process group and sets the rendezvous variables: later tests (which
    check that no group exists for a given WORLD_SIZE) must find neither."""
    keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")
    saved = {k: os.environ.get(k) for k in keys}
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _results(out: str) -> dict[str, Any]:
    lines = [line for line in out.splitlines() if line.startswith("RESULTS ")]
    assert len(lines) == 1 and out.rstrip().splitlines()[-1] == lines[0]
    results: dict[str, Any] = json.loads(lines[0].removeprefix("RESULTS "))
    for row in results["rows"]:
        assert set(row) >= ROW_KEYS
    return results


def _live_models() -> int:
    gc.collect()
    return sum(issubclass(type(o), GPT) for o in gc.get_objects())  # type(): no lazy attribute lookups


def test_offload_tiny_run_prints_every_row_and_results(capsys: pytest.CaptureFixture[str]) -> None:
    summary = offload.main([*TINY, "--modes", "plain", "optimizer_offload", "layer_major",
                            "--baselines", "fsdp2_cpu_offload", "deepspeed_zero_offload"])
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line and not line.startswith("RESULTS")}
    for name in ("plain", "optimizer_offload", "layer_major"):
        assert rows[name].endswith("x plain")
    assert "ours (layer_major)" in rows["fsdp2_cpu_offload"]
    assert "deepspeed_zero_offload" in rows  # not installed / needs CUDA: said in its row
    planned = [line.split() for line in out.splitlines() if line.startswith("planner: ")]
    assert [p[1] for p in planned] == ["plain", "optimizer_offload", "layer_major"]  # beside each mode we ran
    results = _results(out)
    assert results == summary
    by_name = {row["name"]: row for row in results["rows"]}
    assert [r["name"] for r in results["rows"]] == ["plain", "optimizer_offload", "layer_major",
                                                    "fsdp2_cpu_offload", "deepspeed_zero_offload"]
    assert all(by_name[n]["status"] == "ok" for n in ("plain", "optimizer_offload", "layer_major"))
    fsdp2 = by_name["fsdp2_cpu_offload"]
    assert fsdp2["status"] == "ok" and math.isfinite(fsdp2["tokens_s"]) and fsdp2["tokens_s"] > 0
    assert by_name["deepspeed_zero_offload"]["status"] != "ok"
    assert by_name["plain"]["params"] == gpt_param_count(gpt_config("tiny", n_layer=2, seq_len=16))
    assert by_name["plain"]["peak_gib"] is None  # no device memory on CPU: null, not NaN
    assert results["search"] == []


def test_a_failing_configuration_is_its_row_and_the_run_goes_on(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    real = offload.measure
    failures: dict[str, Exception] = {
        "plain": torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 100.00 GiB"),
        "optimizer_offload": HostMemoryError("optimizer offload needs 125.00 GiB of host memory but 120.00 GiB"),
    }

    def measure(setup: Any, name: str) -> Any:
        if name in failures:
            raise failures[name]
        return real(setup, name)

    monkeypatch.setattr(offload, "measure", measure)
    offload.main([*TINY, "--modes", "plain", "optimizer_offload", "layer_major", "--no-baselines"])
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line and not line.startswith("RESULTS")}
    assert rows["plain"].split(maxsplit=1)[1] == "OOM (device)"
    assert rows["optimizer_offload"].split(maxsplit=1)[1].startswith("host memory: optimizer offload needs")
    assert rows["layer_major"].endswith("1.00x layer_major")
    assert "ratio to layer_major (plain did not run)" in out
    statuses = {row["name"]: row["status"] for row in _results(out)["rows"]}
    assert statuses["plain"] == "OOM (device)" and statuses["layer_major"] == "ok"
    assert statuses["optimizer_offload"].startswith("host memory:")


@pytest.mark.parametrize("mode", ["plain", "layer_major"])
def test_a_failed_step_leaves_no_model_alive(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    # layer_major fails inside a worker thread whose exception the runner keeps: without
    # care its traceback would keep the engine (and on CUDA its device memory) forever.
    def loss(outputs: Any, batch: Any) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory.")

    monkeypatch.setattr(offload, "causal_lm_loss", loss)
    setup = offload.Setup(gpt_config("tiny", n_layer=2, seq_len=16), 2, 2, 1, "cpu")
    before = _live_models()
    result = offload.run_isolated(mode, setup, functools.partial(offload.measure, setup, mode), 0)
    assert result.status == "OOM (device)"
    assert _live_models() == before


def test_search_stops_at_the_host_limit_without_building_the_model(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    setup = offload.Setup(gpt_config("tiny", n_layer=2, seq_len=16), 2, 2, 1, "cpu")
    fits = offload.host_bytes(setup.depth(4), "layer_major")
    assert offload.host_bytes(setup.depth(5), "layer_major") > fits
    monkeypatch.setattr(offload, "available_host_bytes", lambda: int(fits / offload.HOST_MARGIN) + 1)
    built: list[int] = []
    real = offload.build_model

    def build_model(cfg: Any) -> Any:
        built.append(cfg.n_layer)
        return real(cfg)

    monkeypatch.setattr(offload, "build_model", build_model)
    offload.main([*TINY, "--search", "--search-only", "--modes", "layer_major"])
    out = capsys.readouterr().out
    assert sorted(built) == [1, 2, 4]  # 8, 6 and 5 were refused before anything was built
    line = next(line for line in out.splitlines() if line.startswith("largest layer_major"))
    assert "n_layer      4" in line and "limit: host memory" in line
    [depth] = _results(out)["search"]
    assert depth["n_layer"] == 4 and depth["limit"] == "host memory" and not depth["lower_bound"]
    assert depth["params"] == gpt_param_count(gpt_config("tiny", n_layer=4, seq_len=16))


def test_search_depth_limit_and_time_budget() -> None:
    setup = offload.Setup(gpt_config("tiny", n_layer=2, seq_len=16), 2, 2, 1, "cpu")
    limited = offload.largest_depth(setup, "plain", limit=3)
    assert (limited.n_layer, limited.limit, limited.lower_bound) == (3, "depth limit", False)
    spent = offload.largest_depth(setup, "plain", limit=3, budget_s=0.0)
    assert (spent.n_layer, spent.limit, spent.lower_bound) == (0, "time budget", True)


def test_cheap_model_is_tied_and_trains_with_a_finite_loss() -> None:
    cfg = gpt_config("tiny", n_layer=3, seq_len=16)
    model = offload.build_model(cfg)
    assert model.head.weight is model.tok_emb.weight
    assert sum(p.numel() for p in model.parameters()) == gpt_param_count(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17))
    loss = causal_lm_loss(model(tokens[:, :-1]), (tokens[:, :-1], tokens[:, 1:]))
    loss.backward()
    assert math.isfinite(loss.item()) and 0 < loss.item() < 10


def test_cpu_adam_tiny_run(capsys: pytest.CaptureFixture[str]) -> None:
    # DeepSpeedCPUAdam's JIT build takes over a minute of a CI run; the script's DeepSpeed row
    # is for the benchmark itself.
    cpu_adam.main(["--numel", "100_000", "--tensors", "4", "--steps", "1", "--triad-numel", "1_000_000",
                   "--only", "torch_fused,torch_foreach,torch_for_loop"])
    out = capsys.readouterr().out
    results = json.loads(out.splitlines()[-1].removeprefix("RESULTS "))
    rows = {row["name"]: row for row in results["rows"]}
    assert {"torch_fused", "torch_foreach", "torch_for_loop"} <= set(rows)
    assert all(rows[n]["status"] == "ok" and rows[n]["params_s"] > 0 for n in ("torch_fused", "torch_for_loop"))
    assert rows["torch_fused"]["max_abs_diff"] < 1e-5
    # The fraction of the host's bandwidth is the bytes an Adam step streams over the triad's rate.
    fused = rows["torch_fused"]
    assert fused["bytes_s"] == pytest.approx(fused["params_s"] * 28)
    assert fused["bandwidth_fraction"] == pytest.approx(fused["bytes_s"] / results["host_memory_triad_bytes_s"])


def test_wait_before_reads_tiny_run(capsys: pytest.CaptureFixture[str]) -> None:
    ratios = _load("wait_before_reads").main(["--model", "gpt-tiny", "--batch", "2", "--steps", "1", "--rounds", "1"])
    assert ratios["calls"] > 10 and ratios["guarded"] > 0 and ratios["settled"] > 0
    assert "guarded/bare" in capsys.readouterr().out


def test_peers_without_deepspeed_are_skipped_with_their_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where DeepSpeed is not installed its rows say so and still carry the settings they would run."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "deepspeed" else real(name, *rest))
    summary = offload.main([*TINY, "--modes", "optimizer_offload", "--baselines", "deepspeed_zero_offload",
                            "deepspeed_zero3_offload"])
    peers = {row["name"]: row for row in summary["rows"] if row["kind"] == "baseline"}
    assert {name: (row["status"], row["reason"]) for name, row in peers.items()} == {
        name: ("skipped", "deepspeed not installed") for name in ("deepspeed_zero_offload", "deepspeed_zero3_offload")}
    assert peers["deepspeed_zero_offload"]["config"]["zero_optimization"]["stage"] == 2
    assert peers["deepspeed_zero3_offload"]["config"]["zero_optimization"]["stage"] == 3


def test_peer_settings_follow_their_experts() -> None:
    """One micro-batch per step (DeepSpeed's fast path), ZeRO-3 prefetching two blocks and keeping
    three live, SuperOffload as an offload_optimizer key, checkpointing only where asked."""
    peers = sys.modules["peers"]
    setup = offload.Setup(gpt_config("tiny", n_layer=4, seq_len=16), 2, 4, 3, "cpu", peer_checkpointing=True)
    layer = peers.block_params(setup)
    zero3 = peers.deepspeed_config(setup, "deepspeed_zero3_offload")
    assert (zero3["train_micro_batch_size_per_gpu"], zero3["gradient_accumulation_steps"]) == (8, 1)
    section = zero3["zero_optimization"]
    assert (section["stage3_prefetch_bucket_size"], section["stage3_max_live_parameters"]) == (2 * layer, 3 * layer)
    assert section["offload_param"] == section["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert peers.zero_settings(setup, "deepspeed_super_offload")["offload_optimizer"]["super_offload"] is True
    fsdp2 = peers.peer_config(setup, "fsdp2_cpu_offload")
    assert fsdp2["reshard_after_forward"] is False and fsdp2["mixed_precision"]["reduce_dtype"] == "float32"
    assert fsdp2["activation_checkpointing"].startswith("every block")
    model = peers.build_peer_model(setup)
    assert all(isinstance(block, peers.CheckpointedBlock) for block in model.blocks)
