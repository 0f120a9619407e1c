"""Fill the device: a fitting variant grows each knob that trades device memory for time,
as far as the device (less the margin) still holds it.

The knobs are settings the runtime implements today, each with device memory that grows
monotonically along it, so the largest fitting value is found by bisection:

- ``layer_streaming.keep_blocks_for_backward`` (streaming): more blocks kept from forward to
  backward, fewer uploads;
- ``activation_checkpointing.every_n_blocks``: a longer interval keeps more blocks'
  activations, less recomputation;
- ``zero_optimization.offload_optimizer.ratio`` (optimizer offload or layer streaming on one
  process, DeepSpeed's Twin-Flow): a lower ratio updates more parameters on the device (under
  streaming their blocks stay resident), a shorter host step and fewer bytes over the link.

A grown value is taken only when it is predicted faster. A streaming variant whose host
state does not fit host memory is first given the largest ratio whose host state fits
(:func:`fit_host`): host bytes fall with the ratio as device bytes rise.

Kept blocks and the ratio compete for the same device bytes, and which pays more depends on
what binds: a kept block saves an upload (and, with images cast per upload, a host cast), a
lower ratio shortens the host step. A streaming variant is therefore filled in both orders
(its kept blocks first, then the ratio; or the ratio first from no kept blocks, then the
kept blocks) and the faster fill is taken. The ratio is also grown with Twin-Flow's device
share on the first parameters (``offload_optimizer.device_share: first``; under streaming,
ratio first): the next forward runs through them while a deferred host step updates the
rest, but under streaming their blocks' activations live until the end of backward, beside
every gradient held on the device — unless they are checkpointed: a streaming variant is also
filled with every, every 2nd or every 3rd resident block checkpointed (``activation_checkpointing``
under streaming), the room it frees going to a lower ratio where that pays for the recomputation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hybridtrain.config import Config, ConfigError
from hybridtrain.planner.estimate import Estimate, ModelSource, Target, estimate

RATIO_STEP = 0.01
"""Twin-Flow ratios tried: multiples of this below the variant's own (one block of a 32-block
model is about 0.03: a coarser step leaves device memory idle)."""
FIT_RATIO_STEP = 0.01
"""Twin-Flow ratios :func:`fit_host` tries: the host's last gigabytes decide a fit."""

RESIDENT_INTERVALS = (1, 2, 3)
"""Under streaming, the checkpoint intervals tried over the blocks that stay on the device
(every one, every 2nd, every 3rd): what recomputing them frees goes to a lower ratio."""

SHARE_FIRST = "Twin-Flow's device share the first parameters"
"""The words for ``offload_optimizer.device_share: first``."""

Variant = tuple[Config, tuple[str, ...], Estimate]


def keep_most(variant: Config, changes: tuple[str, ...], est: Estimate, target: Target, world: int,
              margin: float, model: ModelSource | None) -> Variant:
    """The streaming variant (either order) with the most kept blocks
    (``keep_blocks_for_backward``) that still fits: -1 when all fit, else the largest count
    (device memory grows with it, bytes up shrink)."""
    streamed = sum(1 for b in est.plan.blocks if b.stream)
    if not streamed:
        return variant, changes, est
    trial = _with_keep(variant, -1)
    trial_est = estimate(trial, target, world, all_passes=True, model=model)
    if not trial_est.problems(margin):
        return trial, (*changes, "keep all streamed blocks for backward"), trial_est
    found = _largest_fitting(list(range(1, streamed)), lambda n: _with_keep(variant, n), target, world, margin, model)
    if found is None:
        return variant, changes, est
    count, config, grown = found
    return config, (*changes, f"keep {count} streamed blocks for backward"), grown


def fill_device(variant: Config, changes: tuple[str, ...], est: Estimate, target: Target, world: int,
                margin: float, model: ModelSource | None) -> Variant:
    """``variant`` with its checkpoint interval, then its Twin-Flow ratio, grown as far as
    the device holds them, each only where predicted faster; a streaming variant also
    filled ratio first, the faster fill taken (see the module docstring)."""
    best: Variant = (variant, changes, est)
    checkpointed = variant.activation_checkpointing
    blocks = len(est.plan.blocks)
    if checkpointed.enabled and est.plan.checkpoint_modules and not any(b.stream for b in est.plan.blocks):
        intervals = list(range(checkpointed.every_n_blocks + 1, blocks + 1))
        best = _grown(best, intervals, _with_interval, "checkpoint every {} blocks", target, world, margin, model,
                      replaces="checkpoint every")
    best = grow_ratio(best, target, world, margin, model)
    opt = est.plan.optimizer
    if world != 1 or opt.placement not in ("host", "host_streamed"):
        return best
    streams = any(b.stream for b in est.plan.blocks)
    starts = [(variant, changes)] if streams else []
    if not opt.device_share_first:
        starts.append((_with_share_first(variant), (*changes, SHARE_FIRST)))
    if streams and not variant.activation_checkpointing.enabled:
        starts += [(_with_resident_checkpoints(start, every), (*start_changes, _resident_words(every)))
                   for start, start_changes in list(starts) for every in RESIDENT_INTERVALS]
    for start, start_changes in starts:
        filled = _ratio_before_kept(start, start_changes, target, margin, model) if streams \
            else _ratio_grown_from(start, start_changes, target, margin, model)
        if filled is not None and filled[2].step_seconds < best[2].step_seconds:
            best = filled
    return best


def _ratio_grown_from(variant: Config, changes: tuple[str, ...], target: Target, margin: float,
                      model: ModelSource | None) -> Variant | None:
    """``variant`` (optimizer offload) with its ratio grown; None when it does not fit as it is."""
    est = estimate(variant, target, 1, all_passes=True, model=model)
    return None if est.problems(margin) else grow_ratio((variant, changes, est), target, 1, margin, model)


def grow_ratio(best: Variant, target: Target, world: int, margin: float, model: ModelSource | None) -> Variant:
    """``best`` with its Twin-Flow ratio lowered as far as the device holds it, when faster."""
    opt = best[2].plan.optimizer
    if opt.placement not in ("host", "host_streamed") or world != 1:
        return best
    steps = round(opt.host_ratio / RATIO_STEP)
    ratios = [round(RATIO_STEP * n, 4) for n in range(steps - 1, 0, -1)]  # device memory grows along it
    return _grown(best, ratios, _with_ratio, "optimizer offload ratio {} (Twin-Flow: the rest on the device)",
                  target, world, margin, model, replaces="optimizer offload")


def _ratio_before_kept(variant: Config, changes: tuple[str, ...], target: Target, margin: float,
                       model: ModelSource | None) -> Variant | None:
    """The streaming ``variant`` filled the other way round: no kept blocks, the ratio grown
    first, then as many kept blocks as still fit (:func:`keep_most`); None when even that
    lean start does not fit."""
    lean = _with_keep(variant, 0)
    lean_changes = tuple(words for words in changes if not words.startswith("keep "))
    lean_est = estimate(lean, target, 1, all_passes=True, model=model)
    if lean_est.problems(margin):
        return None
    grown = grow_ratio((lean, lean_changes, lean_est), target, 1, margin, model)
    return keep_most(*grown, target, 1, margin, model)


def _grown(best: Variant, values: Sequence[Any], change: Callable[[Config, Any], Config], words: str, target: Target,
           world: int, margin: float, model: ModelSource | None, replaces: str) -> Variant:
    """``best`` with its knob at the last fitting of ``values`` when that is faster; the new
    words take the place of the change starting with ``replaces``."""
    config, changes, est = best
    found = _largest_fitting(values, lambda v: change(config, v), target, world, margin, model)
    if found is None:
        return best
    value, grown_config, grown = found
    if grown.step_seconds >= est.step_seconds:
        return best
    kept = tuple(words_ for words_ in changes if not words_.startswith(replaces))
    return grown_config, (*kept, words.format(value)), grown


def _largest_fitting(values: Sequence[Any], make: Callable[[Any], Config], target: Target, world: int,
                     margin: float, model: ModelSource | None) -> tuple[Any, Config, Estimate] | None:
    """The last of ``values`` (device memory grows along them) whose variant fits, by bisection.
    A value the engine refuses beside the variant's other settings fits nowhere: a lower
    Twin-Flow ratio leaves fewer blocks streamed than the variant keeps for backward, and
    fewer still further along."""
    low, high = 0, len(values) - 1
    found = None
    while low <= high:
        mid = (low + high) // 2
        config = make(values[mid])
        est = _accepted_estimate(config, target, world, model)
        if est is None or est.problems(margin):
            high = mid - 1
        else:
            found = (values[mid], config, est)
            low = mid + 1
    return found


def _accepted_estimate(config: Config, target: Target, world: int, model: ModelSource | None) -> Estimate | None:
    """``config``'s estimate, or None when the engine refuses it (a ratio that leaves no block
    to stream, fewer streamed blocks than are kept)."""
    try:
        return estimate(config, target, world, all_passes=True, model=model)
    except ConfigError:
        return None


def _with_share_first(cfg: Config) -> Config:
    return _with_offload(cfg, device_share="first")


def _with_keep(cfg: Config, keep: int) -> Config:
    streaming = cfg.layer_streaming.model_copy(update={"keep_blocks_for_backward": keep})
    return cfg.model_copy(update={"layer_streaming": streaming})


def _with_resident_checkpoints(cfg: Config, every: int) -> Config:
    return _with_checkpointing(cfg, enabled=True, every_n_blocks=every, module_classes=[])


def _resident_words(every: int) -> str:
    return "checkpoint every resident block" if every == 1 else f"checkpoint every {_ordinal(every)} resident block"


def _ordinal(n: int) -> str:
    return {2: "2nd", 3: "3rd"}.get(n, f"{n}th")


def _with_interval(cfg: Config, every: int) -> Config:
    return _with_checkpointing(cfg, every_n_blocks=every)


def _with_checkpointing(cfg: Config, **settings: Any) -> Config:
    """``cfg`` with ``activation_checkpointing`` settings replaced."""
    section = cfg.activation_checkpointing.model_copy(update=settings)
    return cfg.model_copy(update={"activation_checkpointing": section})


def _with_ratio(cfg: Config, ratio: float) -> Config:
    return _with_offload(cfg, ratio=ratio, gpu_ratio=None)


def _with_offload(cfg: Config, **settings: Any) -> Config:
    """``cfg`` with ``zero_optimization.offload_optimizer`` settings replaced."""
    zero = cfg.zero_optimization
    offload = zero.offload_optimizer.model_copy(update=settings)
    return cfg.model_copy(update={"zero_optimization": zero.model_copy(update={"offload_optimizer": offload})})


def fit_host(variant: Config, changes: tuple[str, ...], est: Estimate, target: Target, world: int,
             margin: float, model: ModelSource | None) -> Variant | None:
    """A layer-streaming ``variant`` over host memory made to fit it, if the device then holds
    it too: its half-width images cast per upload instead of kept (bf16/fp16), then the
    largest Twin-Flow ratio, in steps of :data:`FIT_RATIO_STEP`, whose host state fits
    (bisection: host bytes fall as the ratio does). The result may still be over device
    memory (then it shows how close the nearest plan comes); None when no ratio fits the host."""
    opt = est.plan.optimizer
    host = target.host_memory_bytes
    # Lowering the ratio only adds device bytes: worth trying only where the device holds it now.
    device_over = est.device_peak_bytes > (target.memory_bytes or est.device_peak_bytes) * (1 - margin)
    if opt.placement != "host_streamed" or world != 1 or host is None or est.host_bytes <= host or device_over:
        return None
    if est.plan.compute_dtype is not None and not est.plan.stream_images_per_upload:
        variant = _with_images_per_upload(variant)
        changes = (*changes, "half-width images cast per upload")
        est = estimate(variant, target, world, all_passes=True, model=model)
        if est.host_bytes <= host:
            return variant, changes, est
    ratios = [round(FIT_RATIO_STEP * n, 4) for n in range(round(opt.host_ratio / FIT_RATIO_STEP) - 1, 0, -1)]
    low, high, found = 0, len(ratios) - 1, None
    while low <= high:  # the first ratio (largest) whose host bytes fit
        mid = (low + high) // 2
        trial = _accepted_estimate(_with_ratio(variant, ratios[mid]), target, world, model)
        if trial is None:  # so low that Twin-Flow's share leaves no block to stream: go higher
            high = mid - 1
        elif trial.host_bytes <= host:
            found, high = (ratios[mid], trial), mid - 1
        else:
            low = mid + 1
    if found is None:
        return None
    ratio, fitted = found
    words = f"optimizer offload ratio {ratio} (Twin-Flow: the rest on the device)"
    return _with_ratio(variant, ratio), (*changes, words), fitted


def _with_images_per_upload(cfg: Config) -> Config:
    streaming = cfg.layer_streaming.model_copy(update={"half_images": "per_upload"})
    return cfg.model_copy(update={"layer_streaming": streaming})
