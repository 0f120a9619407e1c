"""DeepSpeed's rules for cutting a :class:`PipelineModule`'s layer list into stages.

A partition is given as DeepSpeed gives it: ``parts`` of ``num_stages + 1`` boundaries,
stage ``s`` holding layers ``parts[s]`` up to (not including) ``parts[s + 1]``.

- ``uniform``: equal layer counts, the first ``n mod k`` stages one layer more
  (DeepSpeed's ``ds_utils.partition_uniform``).
- ``parameters``: each layer weighs its trainable parameter count; ``type:<regex>``: each
  layer whose class (or function) name matches weighs 1, the others 0. Both are cut by
  DeepSpeed's ``ds_utils.partition_balanced``: the contiguous split that minimises the
  spread (heaviest stage minus lightest), ties going to the latest cut. That differs from
  :func:`hybridtrain.parallel.partition.balance`, which minimises the heaviest stage only,
  so the same script gets the same stages as under DeepSpeed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

METHODS = "'parameters', 'uniform' or 'type:<regex>'"


def uniform_parts(num_items: int, num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` near-equal groups of ``num_items`` (empty groups at the
    end when there are fewer items than parts)."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    base, extra = divmod(num_items, num_parts)
    return [p * base + min(p, extra) for p in range(num_parts + 1)]


def balanced_parts(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries of the contiguous split of ``weights`` into ``num_parts`` groups with the
    smallest spread between the heaviest and the lightest group (ties: latest cut)."""
    n = len(weights)
    if n <= num_parts:
        return uniform_parts(n, num_parts)
    prefix = [0.0]
    for weight in weights:
        prefix.append(prefix[-1] + float(weight))
    inf = math.inf
    # For the first i items in j groups: the spread, heaviest and lightest group of the
    # best split, and where its last group starts.
    spread = [[inf] * (num_parts + 1) for _ in range(n + 1)]
    heaviest = [[inf] * (num_parts + 1) for _ in range(n + 1)]
    lightest = [[inf] * (num_parts + 1) for _ in range(n + 1)]
    start = [[0] * (num_parts + 1) for _ in range(n + 1)]
    spread[0][0] = heaviest[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, num_parts) + 1):
            for k in range(i):
                group = prefix[i] - prefix[k]
                high = max(heaviest[k][j - 1], group)
                low = min(lightest[k][j - 1], group)
                cost = high - low
                if spread[i][j] >= cost:  # ">=": among equal spreads the last group starting latest wins
                    spread[i][j], heaviest[i][j], lightest[i][j], start[i][j] = cost, high, low, k
    parts = [n]
    for j in range(num_parts, 0, -1):
        parts.append(start[parts[-1]][j])
    return parts[::-1]


def method_parts(method: str, num_stages: int, param_counts: Sequence[int], names: Sequence[str | None]) -> list[int]:
    """Stage boundaries for a DeepSpeed ``partition_method``.

    Args:
        method: ``parameters``, ``uniform`` or ``type:<regex>`` (case-insensitive, as
            DeepSpeed lower-cases the whole string before reading it).
        num_stages: number of stages.
        param_counts: each layer's trainable parameter count.
        names: each layer's class or function name (None: a callable without a name).

    Raises:
        ValueError: an unknown method, or a ``type:`` regex that matches no layer.
    """
    rule = method.lower()
    if rule == "uniform":
        return uniform_parts(len(param_counts), num_stages)
    if rule == "parameters":
        return balanced_parts(param_counts, num_stages)
    if rule.startswith("type:"):
        pattern = re.compile(rule.split(":")[1], re.IGNORECASE)
        weights = [1 if name is not None and pattern.search(name) else 0 for name in names]
        if not any(weights):
            raise ValueError(f"PipelineModule(partition_method={method!r}): the regex matches no layer's class "
                             f"name; layers: {', '.join(sorted({n for n in names if n}))}")
        return balanced_parts(weights, num_stages)
    raise ValueError(f"PipelineModule(partition_method={method!r}) is not supported; use {METHODS}")
