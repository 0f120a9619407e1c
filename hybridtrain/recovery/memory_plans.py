"""Same-math configs that need less device memory: the ladder OOM recovery climbs, the
planner's choice, and the check that a ``device_memory_limit`` can be met at all.

Every variant computes the same step as the config it comes from: recomputation replays
the forward with the same RNG, swapping, offload and streaming move the same tensors and
the same update to the host, and a smaller micro-batch with more accumulation sums the same
gradient at the same global batch (only when the forward draws no random numbers: dropout
masks drawn per micro-batch differ). Host memory is another memory only beside a GPU, so
on CPU the ladder skips swapping, optimizer offload and streaming (they would not lower the
count).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from hybridtrain.config import BatchSizes, Config, ConfigError, resolve_batch_sizes
from hybridtrain.runtime import device as dev
from hybridtrain.runtime.memory_limit import format_bytes

log = logging.getLogger(__name__)

Replanner = Callable[[Config, int, int], "Config | None"]
"""``replan(config, measured_peak_bytes, limit_bytes)``: a same-math config predicted to fit
(:func:`hybridtrain.planner.search.fallback`, which estimates ``config.model``), or None."""


def less_memory_configs(config: Config, batch: BatchSizes, device: torch.device,
                        random_forward: bool) -> Iterator[tuple[str, Config]]:
    """Same-math variants of ``config`` that need less device memory, one rung further each,
    in the order they are tried: checkpoint every block, swap activations, offload the
    optimizer, stream layers (these three beside a GPU only), halve the micro-batch (only
    when the forward draws no random numbers: dropout masks drawn per micro-batch differ).

    Each variant computes the same step: recomputation replays the forward with the same
    RNG, offload and streaming move the same update to the host, and a smaller micro-batch
    with more accumulation sums the same gradient at the same global batch.
    """
    raw = config.model_dump()
    ac = config.activation_checkpointing
    if not ac.enabled or (ac.every_n_blocks > 1 and not ac.module_classes):
        yield "activation checkpointing of every block", _with(raw, activation_checkpointing={
            "enabled": True, "every_n_blocks": 1})
    if device.type == "cuda":
        if not config.activation_offload.enabled:
            yield "activation swapping", _with(raw, activation_offload={"enabled": True})
        offload = config.zero_optimization.offload_optimizer
        if offload.device == "none" or offload.ratio < 1.0 or config.zero_optimization.stage == 0:
            # Offload settings are ignored at stage 0 (as DeepSpeed ignores them), so the
            # rung also asks for stage 1: on one process the same update, on the host.
            yield "optimizer offload", _with(raw, zero_optimization={
                "stage": max(config.zero_optimization.stage, 1),
                "offload_optimizer": {"device": "cpu", "ratio": 1.0, "gpu_ratio": None}})
        if not config.layer_streaming.enabled:
            yield "layer streaming", _with(raw, layer_streaming={"enabled": True})
    micro, steps = batch.micro_batch, batch.accumulation_steps
    if micro > 1 and config.pipeline.micro_batches is None and not random_forward:
        smaller = max(d for d in range(1, micro // 2 + 1) if micro % d == 0)
        more = steps * micro // smaller
        yield (f"micro-batch {micro} -> {smaller} with {steps} -> {more} accumulation steps",
               _with(raw, train_batch_size=batch.global_batch, train_micro_batch_size_per_gpu=smaller,
                     gradient_accumulation_steps=more))


def draws_random_numbers(model: nn.Module) -> bool:
    """Whether ``model``'s training forward may draw random numbers: a dropout module with
    p > 0, or a Hugging Face config with a positive ``*dropout*``/``*pdrop*`` setting."""
    for module in model.modules():
        if isinstance(module, nn.Dropout | nn.Dropout1d | nn.Dropout2d | nn.Dropout3d | nn.AlphaDropout
                      | nn.FeatureAlphaDropout) and module.p > 0:
            return True
        settings = getattr(getattr(module, "config", None), "__dict__", {})
        if any(("dropout" in k or "pdrop" in k) and isinstance(v, float) and v > 0 for k, v in settings.items()):
            return True
    return False


def describe_changes(old: Config, new: Config) -> str:
    """``activation_checkpointing.enabled: True, train_micro_batch_size_per_gpu: 4``: the
    settings ``new`` changes."""
    def walk(a: dict[str, Any], b: dict[str, Any], prefix: str) -> list[str]:
        out: list[str] = []
        for key, value in b.items():
            if isinstance(value, dict) and isinstance(a.get(key), dict):
                out += walk(a[key], value, f"{prefix}{key}.")
            elif a.get(key) != value:
                out.append(f"{prefix}{key}: {value}")
        return out
    return ", ".join(walk(old.model_dump(), new.model_dump(), "")) or "the same settings"


def planner_fallback(config: Config, measured_peak_bytes: int, limit_bytes: int) -> Config | None:
    """:func:`hybridtrain.planner.search.fallback` (imported when a step runs out of memory:
    the planner traces the model on the meta device)."""
    from hybridtrain.planner.search import fallback

    try:
        return fallback(config, measured_peak_bytes, limit_bytes)
    except (ConfigError, ValueError) as unplanned:
        log.info("oom_recovery: the planner has no fallback: %s", unplanned)
        return None


def _with(raw: dict[str, Any], **changes: Any) -> Config:
    """``raw`` with ``changes`` merged in (nested dicts key by key), validated."""
    def merged(base: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
        out = dict(base)
        for key, value in change.items():
            out[key] = merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
        return out
    return Config.model_validate(merged(raw, changes))


ESTIMATE_MARGIN = 0.25
"""The planner's estimates are within ±25 % of measured peaks (its benchmark's bar), so a
limit is refused before training only when even the estimate lowered by this much is above it."""


def check_limit_reachable(config: Config) -> None:
    """Refuse, before anything is allocated, a ``device_memory_limit`` below what the
    planner estimates for the plan that needs least memory: the config's own plan, or with
    ``oom_recovery`` the end of its ladder (every rung applied, micro-batch 1). Checks one
    process; a config the estimator cannot plan is left to the run.

    Raises:
        ValueError: one line with the numbers.
    """
    limit = config.device_memory_limit
    if limit is None:
        return
    # The planner traces the model on the meta device: imported only when a limit is set.
    from hybridtrain.planner.estimate import estimate, resolve_target

    device = dev.resolve_device(config.device)
    least, changes = config, []
    while config.oom_recovery.enabled:
        # No dropout assumed: a smaller micro-batch is allowed, the estimate can only drop.
        rung = next(less_memory_configs(least, resolve_batch_sizes(least, 1), device, False), None)
        if rung is None:
            break
        changes.append(rung[0])
        least = rung[1]
    try:
        needed = estimate(least, resolve_target("cpu" if device.type == "cpu" else None)).device_peak_bytes
    except (ConfigError, ValueError) as unplanned:
        log.info("device_memory_limit not checked before training: %s", unplanned)
        return
    if needed * (1 - ESTIMATE_MARGIN) > limit:
        plan = f"even with {', '.join(changes)}" if changes else "its plan"
        raise ValueError(f"device_memory_limit = {limit} bytes ({format_bytes(limit)}) is too small: {plan}, a step "
                         f"needs about {needed} bytes ({format_bytes(needed)}, estimated; hybridtrain estimate "
                         "shows the parts); raise the limit")
