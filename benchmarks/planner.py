"""Planner accuracy: the estimator's predictions against measurements on this machine,
with DeepSpeed's and Accelerate's estimators on the same configurations, in the same run.

    python benchmarks/planner.py                 # every configuration (a few minutes on CPU)
    python benchmarks/planner.py --quick         # a handful, for a smoke run

Two parts:

1. **Memory.** For each configuration (reference GPT sizes, Hugging Face GPT-2, Llama and
   Mixtral shrunk by overrides, each technique) the estimator's ``device_peak_bytes`` is
   compared with the peak of live tensor bytes of a real steady-state step (after one
   warm-up step; :class:`~hybridtrain.runtime.memory_limit.LiveTensorBytes` on a CPU,
   ``torch.cuda.max_memory_allocated`` on a GPU). DeepSpeed's
   ``estimate_zero2_model_states_mem_needs_all_live`` / ``estimate_zero3_…`` (model states
   only, for its mixed-precision ZeRO) and Accelerate's ``estimate_training_usage`` (its
   ``accelerate estimate-memory`` figure) are evaluated on the same models; their errors
   are printed beside ours. Each measurement runs in its own process (a run must not
   count what an earlier one left behind).
2. **Ranking.** For a few configurations and device limits, the planner ranks its fitting
   same-math variants; the best few are timed for real. Printed: Kendall's τ between
   predicted and measured step times, and whether the planner's first choice is within
   10 % of the fastest measured one.

The bar (issue #14): memory within ±10 % on at least 90 % of configurations and all within
±25 %; first choice within 10 % of the fastest measured in at least 80 % of cases.
Output: tables, then ``RESULTS {json}``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from typing import Any

MINI = {"model": {"name": "gpt-mini"}, "data": {"seq_len": 128}}
SMALL = {"model": {"name": "gpt-small", "overrides": {"n_layer": 4}}, "data": {"seq_len": 256}}
GPT2 = {"model": {"name": "hf:gpt2", "overrides": {"n_layer": 2, "n_embd": 128, "n_head": 4}}, "data": {"seq_len": 128}}
LLAMA = {"model": {"name": "hf:llama", "overrides": {"num_hidden_layers": 2, "hidden_size": 128,
                                                      "intermediate_size": 256, "num_attention_heads": 4,
                                                      "num_key_value_heads": 2}}, "data": {"seq_len": 128}}
MIXTRAL = {"model": {"name": "hf:mixtral", "overrides": {"num_hidden_layers": 2, "hidden_size": 128,
                                                          "intermediate_size": 256, "num_attention_heads": 4,
                                                          "num_key_value_heads": 2, "num_local_experts": 4}},
           "data": {"seq_len": 128}}
CKPT = {"activation_checkpointing": {"enabled": True}}
OFFLOAD = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}

CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("gpt-tiny", {"model": {"name": "gpt-tiny"}, "data": {"seq_len": 64}, "train_micro_batch_size_per_gpu": 8}),
    ("gpt-mini", {**MINI, "train_micro_batch_size_per_gpu": 4}),
    ("gpt-small (4 layers)", {**SMALL, "train_micro_batch_size_per_gpu": 2}),
    ("gpt-mini accumulation 2", {**MINI, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}),
    ("gpt-mini checkpoint", {**MINI, "train_micro_batch_size_per_gpu": 4, **CKPT}),
    ("gpt-mini checkpoint every 2", {**MINI, "train_micro_batch_size_per_gpu": 4,
                                     "activation_checkpointing": {"enabled": True, "every_n_blocks": 2}}),
    ("gpt-small checkpoint", {**SMALL, "train_micro_batch_size_per_gpu": 4, **CKPT}),
    ("gpt-mini swap", {**MINI, "train_micro_batch_size_per_gpu": 4, "activation_offload": {"enabled": True}}),
    ("gpt-mini checkpoint + swap", {**MINI, "train_micro_batch_size_per_gpu": 4, **CKPT,
                                    "activation_offload": {"enabled": True}}),
    ("gpt-mini optimizer offload", {**MINI, "train_micro_batch_size_per_gpu": 4, **OFFLOAD}),
    ("gpt-mini offload ratio 0.5", {**MINI, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}),
    ("gpt-mini offload + accumulation 2", {**MINI, "train_micro_batch_size_per_gpu": 4,
                                           "gradient_accumulation_steps": 2, **OFFLOAD}),
    ("gpt-mini layer streaming", {**MINI, "train_micro_batch_size_per_gpu": 4, "layer_streaming": {"enabled": True}}),
    ("gpt-mini streaming layer-major", {**MINI, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                                        "layer_streaming": {"enabled": True, "layer_major": True}}),
    ("gpt-mini streaming host boundary", {**MINI, "train_micro_batch_size_per_gpu": 4, "layer_streaming": {
        "enabled": True, "boundary_activations": "host"}}),
    ("gpt-mini bf16", {**MINI, "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}}),
    ("gpt-mini bf16 checkpoint", {**MINI, "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, **CKPT}),
    ("gpt-mini fp16", {**MINI, "train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True}}),
    ("gpt-mini clipping", {**MINI, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0}),
    ("hf gpt2", {**GPT2, "train_micro_batch_size_per_gpu": 4}),
    ("hf gpt2 checkpoint", {**GPT2, "train_micro_batch_size_per_gpu": 4, **CKPT}),
    ("hf llama", {**LLAMA, "train_micro_batch_size_per_gpu": 4}),
    ("hf llama checkpoint", {**LLAMA, "train_micro_batch_size_per_gpu": 4, **CKPT}),
    ("hf mixtral", {**MIXTRAL, "train_micro_batch_size_per_gpu": 4}),
]
QUICK = ["gpt-tiny", "gpt-mini", "gpt-mini checkpoint", "gpt-mini optimizer offload", "hf llama"]

# Ranking cases: a config, the device memory to fit (a share of the plain config's measured
# peak), and how many of the planner's fitting variants to time.
RANKING: list[tuple[str, dict[str, Any], float]] = [
    ("gpt-mini batch 8", {**MINI, "train_batch_size": 8, "train_micro_batch_size_per_gpu": 8}, 0.7),
    ("gpt-mini batch 8, tight", {**MINI, "train_batch_size": 8, "train_micro_batch_size_per_gpu": 8}, 0.45),
    ("gpt-small batch 8", {**SMALL, "train_batch_size": 8, "train_micro_batch_size_per_gpu": 8}, 0.8),
    ("hf llama batch 8", {**LLAMA, "train_batch_size": 8, "train_micro_batch_size_per_gpu": 8}, 0.8),
    ("hf gpt2 batch 8", {**GPT2, "train_batch_size": 8, "train_micro_batch_size_per_gpu": 8}, 0.8),
    ("gpt-tiny batch 16", {"model": {"name": "gpt-tiny"}, "data": {"seq_len": 64}, "train_batch_size": 16,
                           "train_micro_batch_size_per_gpu": 16}, 0.5),
]


def with_device(cfg: dict[str, Any], device: str) -> dict[str, Any]:
    return {**cfg, "device": device, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


# ---------------------------------------------------------------------------------- workers
def _measure_worker(raw: str) -> None:
    """``--measure-one CONFIG``: one config's peak and step time, as one JSON line."""
    from hybridtrain.commands.measure import measure_step

    cfg = json.loads(raw)
    m = measure_step(cfg, timed_steps=3)
    print("MEASURED " + json.dumps({"peak_bytes": m.peak_bytes, "step_seconds": m.step_seconds}))


def _time_worker(raw: str) -> None:
    """``--time-many CONFIGS``: step times of several configs, interleaved rounds (noise on
    a shared machine hits all of them alike), the best round of each (the least disturbed)."""
    from hybridtrain.compose import initialize
    from hybridtrain.data import TokenBatches, load_tokens
    from hybridtrain.models.factory import build_model
    from hybridtrain.models.gpt import causal_lm_loss

    configs = json.loads(raw)
    engines = []
    for cfg in configs:
        data = TokenBatches(load_tokens(None), cfg["data"]["seq_len"], 0.05, 0)
        model = build_model(cfg["model"]["name"], cfg["model"].get("overrides", {}), 256, cfg["data"]["seq_len"], 0)
        engine = initialize(model, cfg, loss_fn=causal_lm_loss,
                            example_batch=data.train_batch(0, cfg.get("train_micro_batch_size_per_gpu") or 1))
        batch = data.train_batch(0, engine.options.batch.global_batch)
        engine.train_batch(batch)
        engines.append((engine, batch))
    times: list[list[float]] = [[] for _ in configs]
    for _ in range(10):
        for k, (engine, batch) in enumerate(engines):
            start = time.perf_counter()
            engine.train_batch(batch)
            times[k].append(time.perf_counter() - start)
    print("TIMED " + json.dumps([min(t) for t in times]))


def _run(flag: str, payload: Any) -> Any:
    # One thread everywhere (predictions measure this machine in the parent): on a shared
    # machine, several threads per process spin against each other and time mostly noise.
    out = subprocess.run([sys.executable, __file__, flag, json.dumps(payload)], capture_output=True, text=True,
                         timeout=900, env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    for line in out.stdout.splitlines():
        if line.startswith(("MEASURED ", "TIMED ")):
            return json.loads(line.split(" ", 1)[1])
    raise RuntimeError(f"{flag} failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}")


# ---------------------------------------------------------------------------------- incumbents
def deepspeed_estimate(cfg: dict[str, Any], model: Any) -> int | None:
    """DeepSpeed's model-states estimate for this config's device memory on one process
    (its ``_all_live`` estimator is run on the same model for the printed table; the
    number comes from the non-printing function it wraps). None: DeepSpeed missing."""
    try:
        from deepspeed.runtime.zero.stage3 import (
            estimate_zero3_model_states_mem_needs,
            estimate_zero3_model_states_mem_needs_all_live,
        )
        from deepspeed.runtime.zero.stage_1_and_2 import (
            estimate_zero2_model_states_mem_needs,
            estimate_zero2_model_states_mem_needs_all_live,
        )
    except ImportError:
        return None
    zero = cfg.get("zero_optimization", {})
    offload = zero.get("offload_optimizer", {}).get("device") == "cpu"
    params = sum(p.numel() for p in model.parameters())
    with contextlib.redirect_stdout(io.StringIO()):
        if zero.get("stage") == 3:
            estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=1)
            largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(params, largest, 1, 1, cpu_offload=offload,
                                                                cpu_offload_params=offload)
        else:
            estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=1)
            cpu, gpu = estimate_zero2_model_states_mem_needs(params, 1, 1, cpu_offload=offload)
    # On a CPU device its host and device figures are the same memory.
    return int(gpu + (cpu if offload else 0))


def accelerate_estimate(cfg: dict[str, Any], model: Any) -> int | None:
    """Accelerate's ``estimate-memory`` training figure (peak over its stages, batch 1)."""
    try:
        from accelerate.commands.estimate import estimate_training_usage
        from accelerate.utils import calculate_maximum_sizes
    except ImportError:
        return None
    total, _ = calculate_maximum_sizes(model)
    precision = "bfloat16" if cfg.get("bf16", {}).get("enabled") else \
        "float16" if cfg.get("fp16", {}).get("enabled") else "float32"
    return int(max(estimate_training_usage(total, precision).values()))


# ---------------------------------------------------------------------------------- parts
def memory_part(names: list[str], device: str) -> list[dict[str, Any]]:
    from hybridtrain.config import load_config
    from hybridtrain.planner.estimate import estimate, meta_model, resolve_target

    rows = []
    for name, base in CONFIGS:
        if name not in names:
            continue
        cfg = with_device(base, device)
        try:
            est = estimate(cfg, resolve_target(device))
        except ValueError as exc:  # ConfigError included: the row says why, the run goes on
            rows.append({"name": name, "status": f"not estimated: {exc}"})
            continue
        model = meta_model(load_config(cfg))
        row: dict[str, Any] = {"name": name, "predicted": est.device_peak_bytes,
                               "deepspeed": deepspeed_estimate(cfg, model),
                               "accelerate": accelerate_estimate(cfg, model)}
        try:
            measured = _run("--measure-one", cfg)
        except RuntimeError as exc:
            row["status"] = str(exc)
            rows.append(row)
            print(f"{name}: {exc}", file=sys.stderr)
            continue
        row.update(measured=measured["peak_bytes"], step_seconds=measured["step_seconds"],
                   predicted_seconds=est.step_seconds)
        for key in ("predicted", "deepspeed", "accelerate"):
            if row[key] is not None:
                row[f"{key}_error"] = (row[key] - row["measured"]) / row["measured"]
        rows.append(row)
        print(f"{name}: predicted {row['predicted'] / 2**20:.2f} MiB, measured {row['measured'] / 2**20:.2f} MiB "
              f"({row['predicted_error']:+.1%})", file=sys.stderr)
    return rows


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's τ-a of two equally long lists (1: same order, -1: reversed)."""
    pairs = concordant = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            pairs += 1
            s = (a[i] - a[j]) * (b[i] - b[j])
            concordant += 1 if s > 0 else -1 if s < 0 else 0
    return concordant / pairs if pairs else 1.0


def ranking_part(device: str, top: int) -> list[dict[str, Any]]:
    from hybridtrain.planner.estimate import Target, estimate, resolve_target
    from hybridtrain.planner.search import plan

    rows: list[dict[str, Any]] = []
    for name, base, share in RANKING:
        cfg = with_device(base, device)
        target = resolve_target(device)
        limit = int(estimate(cfg, target).device_peak_bytes * share)
        result = plan(cfg, Target(target.kind, target.name, limit, None))
        # The fastest predicted, then variants spread over the ranking (not near-duplicates).
        ranked = list(result.ranked)
        if not ranked:
            rows.append({"name": name, "status": "nothing fits"})
            continue
        step = max(1, len(ranked) // top)
        chosen = [ranked[0], *ranked[step::step]][:top]
        configs = [c.config.model_dump(mode="json") for c in chosen]
        try:
            measured = _run("--time-many", configs)
        except RuntimeError as exc:
            rows.append({"name": name, "status": str(exc)})
            continue
        predicted = [c.estimate.step_seconds for c in chosen]
        fastest = min(measured)
        rows.append({"name": name, "limit_bytes": limit, "variants": [c.describe() for c in chosen],
                     "predicted": predicted, "measured": measured, "tau": kendall_tau(predicted, measured),
                     "first_within_10pct": measured[0] <= 1.1 * fastest, "first_vs_fastest": measured[0] / fastest})
        print(f"{name}: tau {rows[-1]['tau']:+.2f}, first/fastest {measured[0] / fastest:.2f}", file=sys.stderr)
        for words, p, m in zip(rows[-1]["variants"], predicted, measured, strict=True):
            print(f"   predicted {p:.4f} s, measured {m:.4f} s: {words}", file=sys.stderr)
    return rows


H100_TECHNIQUES: list[tuple[str, dict[str, Any]]] = [
    ("plain", {}),
    ("activation checkpointing", CKPT),
    ("checkpointing + activation swapping", {**CKPT, "activation_offload": {"enabled": True}}),
    ("optimizer offload", {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}),
    ("checkpointing + optimizer offload", {**CKPT, "zero_optimization": {"stage": 1, "offload_optimizer": {
        "device": "cpu"}}}),
    ("layer streaming", {"layer_streaming": {"enabled": True}}),
    ("layer streaming, layer-major", {"layer_streaming": {"enabled": True, "layer_major": True,
                                                          "boundary_activations": "host"}}),
]
H100_SIZES = ["gpt-1.3b", "gpt-2.7b", "gpt-6.7b", "gpt-13b"]
H100_HOST_BANDWIDTH = 152.3e9
"""Host memory bandwidth of the H100 machine: the in-place STREAM triad measured there at 16
threads on 2026-11-26 (benchmarks/results/h100-2026-11-26/; fused CPU AdamW reached 0.996 of it)."""


def h100_part() -> dict[str, Any]:
    """The planner's predictions for one H100 80GB with 128 GiB of host memory: the
    largest reference GPT each technique trains (bf16, sequence 1024, micro-batch 1,
    16 accumulation steps), and tokens/s at 6.7B, per technique and for the planner's
    own choice; and the offload issue's target, 6.7B layer-major at 65,536 tokens per step
    (8 × 1024 × 8 micro-batches) with its MFU and parts. The host's memory bandwidth is the
    one measured on that machine (:data:`H100_HOST_BANDWIDTH`). Predictions only."""
    from hybridtrain.models.gpt import gpt_config, gpt_param_count
    from hybridtrain.planner.estimate import Target, estimate
    from hybridtrain.planner.search import choose

    target = Target("cuda", "H100 SXM", 80 * 2**30, 128 * 2**30, H100_HOST_BANDWIDTH)
    base = {"data": {"seq_len": 1024}, "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 16, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    largest: dict[str, str | None] = {}
    at_6_7b: dict[str, dict[str, float] | None] = {}
    for name, tech in H100_TECHNIQUES:
        largest[name] = None
        for size in H100_SIZES:
            est = estimate({**base, **tech, "model": {"name": size}}, target, all_passes=True)
            fits = not est.problems(0.10)
            if size == "gpt-6.7b":
                at_6_7b[name] = {"tokens_per_s": est.tokens_per_step / est.step_seconds,
                                 "device_gib": est.device_peak_bytes / 2**30, "host_gib": est.host_bytes / 2**30,
                                 "fits": fits}
            if not fits:
                break
            largest[name] = size
        print(f"H100: {name}: largest {largest[name]}", file=sys.stderr)
    chosen = choose({**base, "train_batch_size": 16, "gradient_accumulation_steps": None,
                     "model": {"name": "gpt-6.7b"}}, target)
    best = estimate(chosen, target)
    planner = {"config": chosen.model_dump(mode="json", exclude_defaults=True),
               "tokens_per_s": best.tokens_per_step / best.step_seconds,
               "device_gib": best.device_peak_bytes / 2**30, "host_gib": best.host_bytes / 2**30}
    big = {**base, "model": {"name": "gpt-6.7b"}, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 8,
           "layer_streaming": {"enabled": True, "layer_major": True, "boundary_activations": "host"}}
    est = estimate(big, target)
    cfg = gpt_config("6.7b", seq_len=1024)
    flops_per_token = 6 * gpt_param_count(cfg) + 12 * cfg.n_layer * cfg.seq_len * cfg.d_model  # PaLM's MFU
    tokens_s = est.tokens_per_step / est.step_seconds
    target_64k = {"tokens_per_step": est.tokens_per_step, "step_s": est.step_seconds, "tokens_per_s": tokens_s,
                  "mfu": flops_per_token * tokens_s / 989e12, "time": est.time.as_dict(),
                  "device_gib": est.device_peak_bytes / 2**30, "host_gib": est.host_bytes / 2**30,
                  "fits": not est.problems(0.10)}
    return {"largest": largest, "at_6_7b": at_6_7b, "planner_6_7b": planner, "layer_major_6_7b_64k": target_64k}


# Measured on one NVIDIA H100 80GB HBM3 (driver 580.159.04), 16 cores, 125.9 GiB host, torch
# 2.11.0+cu130, 2026-11-26, with benchmarks/offload.py (bf16 autocast, AdamW, 8 x 1024 tokens x
# 2 micro-batches): (size, mode, step seconds, max_memory_allocated GiB). The layer-major 1.3B
# and optimizer offload steps are the clean run of call 3 (1.22 s and 0.734 s in call 1, disturbed by a
# background compile).
H100_MEASURED: list[tuple[str, str, float, float]] = [
    ("1.3b", "plain", 0.310, 34.27), ("1.3b", "checkpointing", 0.379, 22.63),
    ("1.3b", "activation_swap", 0.408, 22.63), ("1.3b", "optimizer_offload", 0.745, 20.73),
    ("1.3b", "layer_streaming", 0.890, 1.61), ("1.3b", "layer_major", 0.664, 4.99),
    ("6.7b", "layer_major", 2.331, 13.10),
]


def _offload_benchmark() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("offload_benchmark", os.path.join(os.path.dirname(__file__),
                                                                                   "offload.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def measured_h100_part(accumulations: tuple[int, ...] = (2, 8)) -> dict[str, Any]:
    """The planner's estimates for the configurations measured on the H100 machine
    (:data:`H100_MEASURED`), planned on this machine for that one (its GPU, 125.9 GiB of host
    memory, :data:`H100_HOST_BANDWIDTH`) as the code that ran there (full-width transfers,
    no pipelined host step: ``half_width=False, pipelined_host_step=False``), beside the
    measurements; then today's code's predictions for GPT-6.7B with gradient clipping (the
    usual LLM setting) at 8 x 1024 tokens x each of ``accumulations`` micro-batches (16k and
    64k tokens per step): layer-major with all blocks kept for backward, and the planner's
    own choice, with the parts and what binds the step."""
    import torch

    from hybridtrain.models.gpt import GPT, causal_lm_loss, gpt_config
    from hybridtrain.planner.estimate import Target, estimate, model_source
    from hybridtrain.planner.search import choose

    bench = _offload_benchmark()
    target = Target("cuda", "H100 SXM", 80 * 2**30, int(125.9 * 2**30), H100_HOST_BANDWIDTH)

    def planned(size: str, mode: str, accumulation: int = 2, today: bool = False,
                **settings: Any) -> Any:
        setup = bench.Setup(gpt_config(size, seq_len=1024), 8, accumulation, 1, "cuda")
        with torch.device("meta"):
            model = GPT(setup.model)
        example = tuple(t[:setup.batch].to("meta") for t in setup.example())
        # The H100 ran the code before half-width transfers (fp32 both ways) and before the
        # pipelined host step: planned as such unless ``today``.
        return setup, estimate(_merged(bench.engine_config(setup, mode), settings), target,
                               model=model_source(model, example, causal_lm_loss), half_width=today,
                               pipelined_host_step=today)

    rows = []
    print(f"{'size':5s} {'mode':18s} {'step s meas/plan':>17s} {'ratio':>6s} {'peak GiB meas/plan':>19s} {'ratio':>6s}")
    for size, mode, step_s, peak_gib in H100_MEASURED:
        _, est = planned(size, mode)
        plan_gib = est.device_peak_bytes / 2**30
        rows.append({"size": size, "mode": mode, "measured_step_s": step_s, "planned_step_s": est.step_seconds,
                     "measured_peak_gib": peak_gib, "planned_peak_gib": plan_gib,
                     "time": est.time.as_dict()})
        print(f"{size:5s} {mode:18s} {step_s:8.3f}/{est.step_seconds:<8.3f} {step_s / est.step_seconds:6.2f} "
              f"{peak_gib:9.2f}/{plan_gib:<9.2f} {peak_gib / plan_gib:6.2f}")
    predictions = {}
    # Clipping defers the host step (it needs every gradient) and keeps the fp32 gradients in
    # host memory: block inputs stay on the device (recomputed) so the host fits at 64k.
    today = {"gradient_clipping": 1.0, "layer_streaming": {"boundary_activations": "recompute",
                                                            "keep_blocks_for_backward": -1}}
    for accumulation in accumulations:
        setup, est = planned("6.7b", "layer_major", accumulation, today=True, **today)
        tokens = setup.batch * accumulation * setup.model.seq_len
        t = est.time
        binding = {"device compute (with recomputation)": t.compute + t.recompute,
                   "host<->device link (all bytes / 50 GB/s)": t.transfers, "host optimizer step": t.host_step}

        def mfu(seconds: float, setup: Any = setup, tokens: int = tokens) -> float:
            return setup.flops_per_token() * tokens / seconds / 989e12
        prediction = {"tokens_per_step": tokens, "step_s": est.step_seconds, "mfu": mfu(est.step_seconds),
                      "device_peak_gib": est.device_peak_bytes / 2**30, "host_gib": est.host_bytes / 2**30,
                      "problems": est.problems(0.10), "host_step_exposed_s": t.host_step_exposed,
                      "next_forward_s_approx": t.compute / 3,  # forward FLOPs are a third of fwd+bwd
                      "parts_s": binding, "binds": max(binding, key=binding.__getitem__)}
        print(f"GPT-6.7B layer-major, clipping, {tokens:,} tokens/step (prediction): {est.step_seconds:.2f} s, "
              f"MFU {prediction['mfu']:.1%}, device {prediction['device_peak_gib']:.1f} GiB, host "
              f"{prediction['host_gib']:.1f} GiB; " + ", ".join(f"{k} {v:.2f} s" for k, v in binding.items())
              + f", host step exposed {t.host_step_exposed:.2f} s; binds: {prediction['binds']}")
        base = bench.engine_config(setup, "plain")
        base.pop("model", None)
        chosen = choose({**base, "gradient_clipping": 1.0, "model": {"name": "gpt-6.7b"},
                         "data": {"seq_len": 1024}}, target)
        best = estimate(chosen, target)
        prediction["planner_choice"] = {"step_s": best.step_seconds, "mfu": mfu(best.step_seconds),
                                        "summary": {k: best.plan.summary()[k] for k in (
                                            "batch", "checkpointed", "streamed", "step_runner", "optimizer")}}
        print(f"planner's choice at {tokens:,} tokens/step (prediction): {best.step_seconds:.2f} s, "
              f"MFU {mfu(best.step_seconds):.1%}: {prediction['planner_choice']['summary']}")
        predictions[f"gpt_6_7b_{tokens // 1024}k"] = prediction
    return {"rows": rows, **predictions}


def _merged(base: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``settings`` laid over it, one section deep."""
    out = dict(base)
    for key, value in settings.items():
        out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) else value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few configurations only")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--top", type=int, default=5, help="variants timed per ranking case")
    parser.add_argument("--only", choices=("memory", "ranking", "h100", "h100-measured"), help="run one part only")
    parser.add_argument("--measure-one", help=argparse.SUPPRESS)
    parser.add_argument("--time-many", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    if args.measure_one:
        return _measure_worker(args.measure_one)
    if args.time_many:
        return _time_worker(args.time_many)
    if args.only == "h100-measured":
        print("H100_MEASURED " + json.dumps(measured_h100_part()))
        return
    if args.only == "h100":
        print("H100 " + json.dumps(h100_part()))
        return
    names = QUICK if args.quick else [n for n, _ in CONFIGS]
    memory = memory_part(names, args.device) if args.only != "ranking" else []
    ranking = ranking_part(args.device, args.top) if not args.quick and args.only != "memory" else []
    print(render(memory, ranking))
    print("RESULTS " + json.dumps({"machine": machine(), "memory": memory, "ranking": ranking}))


def machine() -> str:
    import torch

    cores = os.cpu_count()
    return (f"{platform.processor() or platform.machine()}, {cores} cores, torch {torch.__version__}, "
            f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC")


def render(memory: list[dict[str, Any]], ranking: list[dict[str, Any]]) -> str:
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:+.1%}"
    lines = [f"{'configuration':36} {'measured':>10} {'ours':>10} {'error':>8} {'DeepSpeed':>10} {'Accelerate':>10}"]
    done = [r for r in memory if "measured" in r]
    for r in memory:
        if "measured" not in r:
            lines.append(f"{r['name']:36} {r.get('status', '')}")
            continue
        lines.append(f"{r['name']:36} {r['measured'] / 2**20:9.2f}M {r['predicted'] / 2**20:9.2f}M "
                     f"{pct(r['predicted_error']):>8} {pct(r.get('deepspeed_error')):>10} "
                     f"{pct(r.get('accelerate_error')):>10}")
    if done:
        errors = [abs(r["predicted_error"]) for r in done]
        within10 = sum(e <= 0.10 for e in errors) / len(errors)
        lines.append(f"ours: {within10:.0%} of {len(errors)} within ±10 %, worst {max(errors):.1%} "
                     f"(bar: ≥90 % within ±10 %, all within ±25 %)")
        for key, label in (("deepspeed_error", "DeepSpeed"), ("accelerate_error", "Accelerate")):
            theirs = [abs(r[key]) for r in done if r.get(key) is not None]
            if theirs:
                lines.append(f"{label}: {sum(e <= 0.10 for e in theirs) / len(theirs):.0%} within ±10 %, "
                             f"median error {statistics.median(theirs):.0%} (model states only)")
            else:
                lines.append(f"{label}: not installed")
    if ranking:
        lines.append("")
        lines.append(f"{'ranking case':28} {'tau':>6} {'first/fastest':>14}")
        cases = [r for r in ranking if "tau" in r]
        for r in ranking:
            lines.append(f"{r['name']:28} " + (f"{r['tau']:+6.2f} {r['first_vs_fastest']:14.2f}" if "tau" in r
                                               else r.get("status", "")))
        if cases:
            good = sum(r["first_within_10pct"] for r in cases) / len(cases)
            lines.append(f"first choice within 10 % of the fastest measured: {good:.0%} of {len(cases)} "
                         f"(bar: ≥80 %); mean tau {statistics.mean(r['tau'] for r in cases):+.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
