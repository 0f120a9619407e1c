"""The planner's answers for memory policy: the fallback out-of-memory recovery asks for,
and the check that a ``device_memory_limit`` can be met at all. The variants themselves
(the ladder recovery climbs, the planner's grid) are :mod:`hybridtrain.plan.variants`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from hybridtrain.config import Config, ConfigError, resolve_batch_sizes
from hybridtrain.plan.variants import ladder
from hybridtrain.planner.estimate import estimate, resolve_target
from hybridtrain.planner.search import fallback
from hybridtrain.runtime import device as dev
from hybridtrain.units import format_bytes

log = logging.getLogger(__name__)

Replanner = Callable[[Config, int, int], "Config | None"]
"""``replan(config, measured_peak_bytes, limit_bytes)``: a same-math config predicted to fit
(:func:`hybridtrain.planner.search.fallback`, which estimates ``config.model``), or None."""


def planner_fallback(config: Config, measured_peak_bytes: int, limit_bytes: int) -> Config | None:
    """:func:`hybridtrain.planner.search.fallback`, None where the planner cannot plan the
    config (said at info level)."""
    try:
        return fallback(config, measured_peak_bytes, limit_bytes)
    except (ConfigError, ValueError) as unplanned:
        log.info("oom_recovery: the planner has no fallback: %s", unplanned)
        return None


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
    device = dev.resolve_device(config.device)
    least, changes = config, []
    while config.oom_recovery.enabled:
        # No dropout assumed: a smaller micro-batch is allowed, the estimate can only drop.
        rung = next(ladder(least, resolve_batch_sizes(least, 1), device, False), None)
        if rung is None:
            break
        changes.append(rung[0])
        least = rung[1]
    try:
        planned = estimate(least, resolve_target("cpu" if device.type == "cpu" else None))
        # On a CPU the estimate's peak includes the host side (offloaded optimizer state,
        # host masters and buffers: one memory there). A CPU limit stands for a device's
        # memory, and the guard does not count what the host optimizer's worker thread
        # makes: only the device side is held against it (a run that fits is not refused).
        needed = planned.device_peak_bytes - (planned.host_bytes if device.type == "cpu" else 0)
    except (ConfigError, ValueError) as unplanned:
        log.info("device_memory_limit not checked before training: %s", unplanned)
        return
    if needed * (1 - ESTIMATE_MARGIN) > limit:
        plan = f"even with {', '.join(changes)}" if changes else "its plan"
        raise ValueError(f"device_memory_limit = {limit} bytes ({format_bytes(limit)}) is too small: {plan}, a step "
                         f"needs about {needed} bytes ({format_bytes(needed)}, estimated; hybridtrain estimate "
                         "shows the parts); raise the limit")
