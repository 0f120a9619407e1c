"""The space of same-math variants of a config, and its two walks.

A variant changes how a step is computed, never what it computes (each move is exact in
the equivalence tests)::

    move                     why it is the same math
    checkpointing(n)         recomputation replays the forward with the same RNG
    swapping()               the same saved tensors, kept in host memory meanwhile
    optimizer_offload(r)     the same update, computed on the host
    streaming(...)           the same blocks and update, the weights in host memory
    kept_blocks(k)           the same weights, uploaded once more for backward or kept
    micro_batches(m)         the same global batch summed over more, smaller micro-batches
                             (only when the forward draws no random numbers: dropout masks
                             are drawn per micro-batch, see draws_random_numbers)
    layouts(world)           dp × tp × pp and the ZeRO stage (several processes)

Two walks go over this one space: :func:`grid`, every combination, which the planner
estimates and ranks (:mod:`hybridtrain.planner.search`), and :func:`ladder`, one rung
further each, which out-of-memory recovery climbs (:mod:`hybridtrain.recovery.oom`).
Both build variants with :func:`merge` and say what changed with :func:`changed_settings`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hybridtrain.config import BatchSizes, Config, ConfigError, resolve_batch_sizes
from hybridtrain.plan.checks import check_supported, parallel_sizes

Change = dict[str, Any]
"""A partial config (nested like the config) that a move merges in."""


# ---------------------------------------------------------------- the moves
def checkpointing(every_n_blocks: int | None) -> Change:
    """Activation checkpointing of every ``n``-th block (None: none)."""
    if every_n_blocks is None:
        return {"activation_checkpointing": {"enabled": False}}
    return {"activation_checkpointing": {"enabled": True, "every_n_blocks": every_n_blocks}}


def swapping(enabled: bool = True) -> Change:
    """Activation swapping to host memory."""
    return {"activation_offload": {"enabled": enabled}}


def optimizer_offload(cfg: Config, ratio: float | None) -> Change:
    """The optimizer step on the host for ``ratio`` of the parameters (None: on the device).
    Offload settings are ignored at stage 0 (as DeepSpeed ignores them), so offloading also
    asks for stage 1: on one process the same update, on the host."""
    if ratio is None:
        return {"zero_optimization": {"offload_optimizer": {"device": "none"}}}
    return {"zero_optimization": {"stage": max(cfg.zero_optimization.stage, 1), "offload_optimizer": {
        "device": "cpu", "ratio": ratio, "gpu_ratio": None}}}


def gradients_wait(where: str) -> Change:
    """Where offloaded gradients wait for a deferred or summed host step: ``host`` or ``device``."""
    return {"zero_optimization": {"offload_optimizer": {"gradients_wait": where}}}


def streaming(**settings: Any) -> Change:
    """Layer-to-layer streaming (``layer_major``, ``boundary_activations`` … as given)."""
    return {"layer_streaming": {"enabled": True, **settings}}


def kept_blocks(count: int) -> Change:
    """Layer-major streaming keeps its last ``count`` streamed blocks on the device from
    their forward to their backward (-1: all, 0: none, each uploaded again)."""
    return {"layer_streaming": {"keep_blocks_for_backward": count}}


def micro_batches(batch: BatchSizes, micro: int) -> Change:
    """Micro-batches of ``micro`` samples at the same global batch (more accumulation)."""
    return {"train_batch_size": batch.global_batch, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": batch.micro_batch * batch.accumulation_steps // micro}


def micro_batch_may_change(cfg: Config, random_forward: bool) -> bool:
    """The one dropout rule: the micro-batch may change only when the forward draws no
    random numbers (masks drawn per micro-batch differ) and no pipeline fixes its count."""
    return not random_forward and cfg.pipeline.micro_batches is None


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


# ---------------------------------------------------------------- building and comparing
def merge(base: dict[str, Any], change: Change) -> dict[str, Any]:
    """``base`` with ``change`` merged in, nested dicts key by key (neither is changed)."""
    out = dict(base)
    for key, value in change.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def changed_settings(old: Config, new: Config) -> list[tuple[str, Any, Any]]:
    """``(dotted key, old value, new value)`` for each setting ``new`` changes, in the
    config's order."""
    def walk(a: dict[str, Any], b: dict[str, Any], prefix: str) -> Iterator[tuple[str, Any, Any]]:
        for key, value in b.items():
            if isinstance(value, dict) and isinstance(a.get(key), dict):
                yield from walk(a[key], value, f"{prefix}{key}.")
            elif a.get(key) != value:
                yield f"{prefix}{key}", a.get(key), value
    return list(walk(old.model_dump(), new.model_dump(), ""))


def describe_changes(old: Config, new: Config) -> str:
    """``activation_checkpointing.enabled: True, train_micro_batch_size_per_gpu: 4``: the
    settings ``new`` changes."""
    return ", ".join(f"{key}: {value}" for key, _, value in changed_settings(old, new)) or "the same settings"


# ---------------------------------------------------------------- walk 1: the ladder
def ladder(config: Config, batch: BatchSizes, device: torch.device,
           random_forward: bool) -> Iterator[tuple[str, Config]]:
    """Same-math variants of ``config`` that need less device memory, one rung further each,
    in the order out-of-memory recovery tries them: give up the blocks layer streaming keeps
    for backward, checkpoint every block, swap activations, offload the optimizer,
    stream layers (these three beside a GPU only: on CPU host memory is the same memory),
    halve the micro-batch. Rungs this build refuses with ``config`` on one process are
    left out (under layer streaming, optimizer offload: it keeps its blocks' optimizer state
    on the host itself), and so is checkpointing where streaming leaves no block on the
    device (it recomputes its streamed blocks itself; checkpointing wraps the others).

    The order is by what each rung costs in time. Kept blocks cost bandwidth only: without
    them each streamed block but the last is uploaded once more for its backward, while the
    block after it computes its backward (prefetch), and their weight images leave the
    device's peak; every later rung adds work (recomputation, activations or updates over
    the bus, smaller kernels). That rung goes straight to no kept blocks, as checkpointing
    goes straight to every block: each rung costs a failed step and a rebuild, and the
    count that just fits is the planner's to find (a replanner, as ``hybridtrain train``
    has, searches it from the measured peak before this ladder is asked)."""
    raw = config.model_dump()
    for words, change in _rungs(config, batch, device, random_forward):
        variant = Config.model_validate(merge(raw, change))
        try:
            check_supported(variant, 1)
        except ConfigError:
            continue
        yield words, variant


def _rungs(config: Config, batch: BatchSizes, device: torch.device,
           random_forward: bool) -> Iterator[tuple[str, Change]]:
    keep = config.layer_streaming.keep_blocks_for_backward
    if keep != 0:
        yield f"no streamed blocks kept for backward ({'all' if keep < 0 else keep} -> 0)", kept_blocks(0)
    ac = config.activation_checkpointing
    # Under streaming it checkpoints the blocks staying on the device: a rung only where some do.
    stays = config.zero_optimization.offload_optimizer.ratio < 1.0 or bool(config.layer_streaming.resident)
    if (not ac.enabled or (ac.every_n_blocks > 1 and not ac.module_classes)) and \
            (stays or not config.layer_streaming.enabled):
        yield "activation checkpointing of every block", checkpointing(1)
    if device.type == "cuda":
        if not config.activation_offload.enabled:
            yield "activation swapping", swapping()
        offload = config.zero_optimization.offload_optimizer
        if offload.device == "none" or offload.ratio < 1.0 or config.zero_optimization.stage == 0:
            yield "optimizer offload", optimizer_offload(config, 1.0)
        if not config.layer_streaming.enabled:
            yield "layer streaming", streaming()
    micro, steps = batch.micro_batch, batch.accumulation_steps
    if micro > 1 and micro_batch_may_change(config, random_forward):
        smaller = max(d for d in range(1, micro // 2 + 1) if micro % d == 0)
        yield (f"micro-batch {micro} -> {smaller} with {steps} -> {steps * micro // smaller} accumulation steps",
               micro_batches(batch, smaller))


# ---------------------------------------------------------------- walk 2: the grid
def grid(cfg: Config, world_size: int, random_forward: bool) -> Iterator[tuple[tuple[str, ...], Config, int]]:
    """Every same-math variant of ``cfg`` (layouts × micro-batches × techniques), with the
    changes in words and the world size; the config itself first. Combinations the config
    schema refuses are left out.

    Raises:
        ConfigError: the config's own parallel sizes conflict or do not fit ``world_size``.
    """
    base = {**cfg.model_dump(exclude_unset=True), "auto": False}
    own_dp = parallel_sizes(cfg, world_size)[0]
    for layout_words, layout in layouts(world_size):
        dp = layout["data_parallel"]["size"] if layout else own_dp
        for batch_words, batch in _batches(cfg, dp, random_forward):
            for tech_words, tech in _techniques(cfg, world_size):
                try:
                    variant = Config.model_validate(merge(merge(merge(base, layout), batch), tech))
                except ValueError:
                    continue
                yield tuple(w for w in (*layout_words, *batch_words, *tech_words) if w), variant, world_size


def layouts(world: int) -> Iterator[tuple[tuple[str, ...], Change]]:
    """The config's own layout (no change), then every dp × tp × pp split and ZeRO stage."""
    yield (), {}
    if world == 1:
        return
    for tp in _divisors(world):
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            for stage in (0, 1, 2, 3) if dp > 1 else (0,):
                words = (f"dp {dp} × tp {tp} × pp {pp}", f"ZeRO-{stage}" if stage else "")
                yield words, {"tensor_parallel": {"size": tp}, "tensor_model_parallel_size": 1,
                              "pipeline": {"stages": pp}, "pipeline_model_parallel_size": 1,
                              "data_parallel": {"size": dp}, "zero_optimization": {"stage": stage}}


def _batches(cfg: Config, dp: int, random_forward: bool) -> Iterator[tuple[tuple[str, ...], Change]]:
    """Micro-batch × accumulation splits of the same per-rank batch."""
    batch = resolve_batch_sizes(cfg, dp)
    yield (), {}
    if not micro_batch_may_change(cfg, random_forward):
        return
    for micro in _divisors(batch.micro_batch * batch.accumulation_steps):
        if micro != batch.micro_batch:
            change = micro_batches(batch, micro)
            yield (f"micro-batch {micro} × {change['gradient_accumulation_steps']} accumulation",), change


def _techniques(cfg: Config, world: int) -> Iterator[tuple[tuple[str, ...], Change]]:
    """Checkpointing × swapping × optimizer offload, and layer streaming (one process)."""
    # Without streaming, a layer-major config's layer_major and kept blocks would be refused
    # (they need streaming): they go too. Layer-major variants start at no kept blocks (the
    # planner's search raises the count as far as it fits).
    off = merge(merge(merge(checkpointing(None), swapping(False)),
                      {"layer_streaming": {"enabled": False, "layer_major": False}}), kept_blocks(0))
    off["activation_checkpointing"]["every_n_blocks"] = 1
    offloads: list[tuple[str | tuple[str, ...], Change]] = [("", optimizer_offload(cfg, None))]
    # Where gradients wait matters only when something defers the host step.
    waits: list[tuple[str, Change]] = [("", {})]
    if cfg.gradient_clipping > 0 or cfg.fp16.enabled or cfg.nonfinite_loss == "skip":
        waits.append(("gradients wait on the device", gradients_wait("device")))
    if world == 1:
        offloads += [((words, held), merge(optimizer_offload(cfg, ratio), wait)) for held, wait in waits
                     for words, ratio in (("optimizer offload", 1.0), ("optimizer offload ratio 0.5", 0.5))]
    yield (), {}
    for every, ck_words in ((None, ""), (1, "checkpoint every block"), (2, "checkpoint every 2nd block"),
                            (4, "checkpoint every 4th block")):
        for swap in (False, True):
            for off_words, offload in offloads:
                words = (ck_words, "activation swapping" if swap else "", *_words(off_words))
                # Each section replaces ``off``'s whole (no checkpointing keeps the config's interval).
                yield words, {**off, **checkpointing(every), **swapping(swap), **offload}
    if world == 1:
        for layer_major in (False, True):
            for boundary in ("recompute", "host"):
                for held, wait in waits:
                    yield (f"layer streaming{' layer-major' if layer_major else ''}",
                           "boundary activations in host memory" if boundary == "host" else "", held), merge({
                        **off, **streaming(layer_major=layer_major, boundary_activations=boundary,
                                           keep_blocks_for_backward=0)}, wait)


def _words(words: str | tuple[str, ...]) -> tuple[str, ...]:
    return (words,) if isinstance(words, str) else words


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
