"""``plan(config, target)``: the fastest same-math variant of a config that fits.

Variants change how a step is computed, never what it computes (each is exact in the
equivalence tests): micro-batch × accumulation at the same global batch (only when the
forward draws no random numbers: dropout masks are drawn per micro-batch), activation
checkpointing every n blocks, activation swapping, optimizer offload and its ratio,
layer streaming with or without ``layer_major``, and for several processes the
data/tensor/pipeline split and the ZeRO stage. Every variant is estimated
(:mod:`hybridtrain.planner.estimate`; one trace per micro-batch shape serves them all),
those that do not fit with a margin are dropped, the rest ranked by predicted step time;
the fastest few then fill the device (:mod:`hybridtrain.planner.fill`: kept blocks, the
checkpoint interval, the Twin-Flow ratio) and are ranked again.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from hybridtrain.config import Config, ConfigError, ConfigSource, load_config
from hybridtrain.plan.variants import draws_random_numbers, grid
from hybridtrain.planner.estimate import (
    Estimate,
    ModelSource,
    Target,
    estimate,
    meta_model,
    resolve_target,
)
from hybridtrain.planner.fill import fill_device, fit_host, keep_most

MARGIN = 0.10
"""Share of the device memory a plan leaves free: allocator fragmentation and caches,
and the estimate's own error (within ±10 % on the benchmark)."""
FILL_TOP = 5
"""Ranked candidates whose device use the search grows (:mod:`hybridtrain.planner.fill`)."""
EQUAL_TIME = 0.01
"""Predicted step times within this share of each other count as equal: the planner's
time model is not that precise, so among them the one leaving more device memory wins."""


@dataclass(frozen=True)
class Candidate:
    """One variant, estimated.

    Attributes:
        config: the variant's configuration.
        changes: what differs from the given config, in words (empty: the config itself).
        estimate: its estimate.
        problems: why it does not fit (empty when it does).
    """

    config: Config
    changes: tuple[str, ...]
    estimate: Estimate
    problems: tuple[str, ...]

    @property
    def fits(self) -> bool:
        """Whether it fits the target with the margin."""
        return not self.problems

    def describe(self) -> str:
        """``micro-batch 4 × 2 accumulation, checkpoint every block`` or ``as configured``."""
        return ", ".join(self.changes) or "as configured"


@dataclass(frozen=True)
class PlanResult:
    """The planner's answer: every candidate, best first among those that fit."""

    ranked: tuple[Candidate, ...]
    refused: tuple[Candidate, ...]

    @property
    def best(self) -> Candidate | None:
        """The fastest fitting variant, if any."""
        return self.ranked[0] if self.ranked else None


def plan(config: ConfigSource, target: Target, world_size: int = 1, margin: float = MARGIN,
         limit: int | None = None, model: ModelSource | None = None) -> PlanResult:
    """Estimate every same-math variant of ``config`` on ``target`` and rank those that fit.

    Args:
        config: the configuration (its techniques are the starting point, not a constraint).
        target: the device and host memory to fit.
        world_size: processes; variants split them over data, tensor and pipeline parallel.
        margin: share of device memory left free.
        limit: estimate at most this many variants (None: all).
        model: a caller's model instead of the one the config names.

    Raises:
        ConfigError / ValueError: the config itself is invalid (one line).
    """
    cfg = load_config(config)
    estimate(cfg, target, world_size, model=model)  # the config itself must be valid: its errors come first
    ranked: list[Candidate] = []
    refused: list[Candidate] = []
    seen: set[str] = set()
    plans: set[str] = set()
    for changes, variant, world in variants(cfg, world_size, model):
        key = variant.model_dump_json()
        if key in seen:
            continue
        seen.add(key)
        if limit is not None and len(seen) > limit:
            break
        try:
            est = estimate(variant, target, world, all_passes=True, model=model)
        except (ConfigError, ValueError):
            continue  # a combination the engine refuses (e.g. layer_major on two block lists)
        # Variants that resolve to the same plan (checkpoint every 2nd or 4th of two
        # blocks) are one candidate: the first, with the fewest words.
        plan_key = json.dumps([est.plan.summary(), world], sort_keys=True, default=str)
        if plan_key in plans:
            continue
        plans.add(plan_key)
        problems = tuple(est.problems(margin))
        fitted = fit_host(variant, changes, est, target, world, margin, model) if problems else None
        if fitted is not None:
            variant, changes, est = fitted
            problems = tuple(est.problems(margin))
        if not problems and any(b.stream for b in est.plan.blocks):
            variant, changes, est = keep_most(variant, changes, est, target, world, margin, model)
        (refused if problems else ranked).append(Candidate(variant, changes, est, problems))
    refused.sort(key=lambda c: c.estimate.device_peak_bytes)
    # The fastest few grow what trades device memory for time as far as the device holds it
    # (filling every candidate would multiply the estimates for variants that cannot win).
    # They join the others rather than replace them: OOM recovery scales the estimates and
    # may need the leaner original. Without a device limit there is nothing to fill.
    ranked = rank(ranked)
    if target.memory_bytes is not None:
        filled = [Candidate(*_filled(c, target, margin, model), ()) for c in ranked[:FILL_TOP]]
        ranked = rank([c for c, original in zip(filled, ranked, strict=False) if c.changes != original.changes]
                      + ranked)
    return PlanResult(tuple(ranked), tuple(refused))


def _filled(candidate: Candidate, target: Target, margin: float,
            model: ModelSource | None) -> tuple[Config, tuple[str, ...], Estimate]:
    world = candidate.estimate.plan.sizes.world
    return fill_device(candidate.config, candidate.changes, candidate.estimate, target, world, margin, model)


def rank(candidates: list[Candidate], equal: float = EQUAL_TIME) -> list[Candidate]:
    """Fastest first; among candidates whose predicted times are within ``equal`` of the
    fastest of their band, the one leaving the most device memory free first (the same
    speed with room to spare for a longer sequence, a larger batch or a fragmented heap)."""
    by_time = sorted(candidates, key=lambda c: (c.estimate.step_seconds, c.estimate.device_peak_bytes))
    out: list[Candidate] = []
    while by_time:
        limit = by_time[0].estimate.step_seconds * (1 + equal)
        band = [c for c in by_time if c.estimate.step_seconds <= limit]
        by_time = by_time[len(band):]
        out += sorted(band, key=lambda c: (c.estimate.device_peak_bytes, c.estimate.step_seconds))
    return out


def choose(config: ConfigSource, target: Target, world_size: int = 1, margin: float = MARGIN,
           model: ModelSource | None = None) -> Config:
    """The fastest fitting variant's configuration (``auto: true``).

    Raises:
        ValueError: nothing fits; one line with what the least hungry variant needs and
            what the target has.
    """
    result = plan(config, target, world_size, margin, model=model)
    if result.best is None:
        raise ValueError(no_fit_message(result, target))
    return result.best.config.model_copy(update={"auto": False})


def no_fit_message(result: PlanResult, target: Target) -> str:
    """``no plan fits: the smallest (…) needs X, has Y`` for the least hungry variant."""
    if not result.refused:
        return "no plan of this config could be estimated"
    least = result.refused[0]
    return f"no plan fits: the one needing least memory ({least.describe()}) — {'; '.join(least.problems)}"


def fallback(config: ConfigSource, measured_peak_bytes: int, limit_bytes: int,
             target: Target | None = None) -> Config | None:
    """The fastest same-math variant predicted to fit under ``limit_bytes``, the estimates
    calibrated by what this config really used (``measured / predicted``): what OOM
    recovery switches to.

    Args:
        config: the configuration whose step ran out of memory.
        measured_peak_bytes: the bytes it had live when it failed (or its measured peak).
        limit_bytes: the device memory available.
        target: the device (default: this machine's, limited to ``limit_bytes``).

    Returns:
        The variant's config, or None when none is predicted to fit.
    """
    cfg = load_config(config)
    target = target or resolve_target("cpu" if cfg.device == "cpu" else None)
    target = Target(target.kind, target.name, None, target.host_memory_bytes)
    predicted = estimate(cfg, target).device_peak_bytes
    scale = max(1.0, measured_peak_bytes / predicted) if predicted else 1.0
    mine = cfg.model_dump()
    for candidate in plan(cfg, target).ranked:  # fastest first
        fits = candidate.estimate.device_peak_bytes * scale <= limit_bytes * (1 - MARGIN / 2)
        if fits and candidate.config.model_dump() != mine:
            return candidate.config
    return None


def variants(cfg: Config, world_size: int, model: ModelSource | None = None
             ) -> Iterator[tuple[tuple[str, ...], Config, int]]:
    """Every same-math variant of ``cfg`` (:func:`hybridtrain.plan.variants.grid`), with the
    changes in words and the world size; the config itself first."""
    random_forward = draws_random_numbers(model.model if model is not None else meta_model(cfg))
    return grid(cfg, world_size, random_forward)
