"""Splitting a model's blocks into pipeline stages.

The costs to balance are each block's parameter count, or (``partition: time``) its
forward + backward time measured on the device by :func:`time_blocks`. Which stages hold
the parameters outside the blocks, and the shapes stages send each other, come from the
traced forward of :mod:`hybridtrain.models.usage`.

:func:`balance` is the classic contiguous min-max partition (torchgpipe's
``balance_by_time``): no stage's cost exceeds the optimum bottleneck.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn


def time_blocks(model: nn.Module, blocks: Sequence[nn.Module], run_step: Callable[[], torch.Tensor]) -> list[float]:
    """Forward + backward seconds of each block over one step of ``run_step`` (a forward
    of ``model`` returning a loss) and its backward; a warm-up step first, so allocation is
    not timed. The model's gradients are cleared and the RNG state restored afterwards.

    On CUDA the marks are events on the running stream, read after a synchronize: the host
    only queues kernels, so host clocks would measure launch time, not the blocks' work."""
    index = {id(b): i for i, b in enumerate(blocks)}
    on_cuda = any(p.device.type == "cuda" for p in model.parameters())
    marks: list[list[Any]] = [[] for _ in blocks]  # start, stop, start, stop, …

    def mark(module: nn.Module, *_: Any) -> None:
        if on_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            marks[index[id(module)]].append(event)
        else:
            marks[index[id(module)]].append(time.perf_counter())
    start = stop = mark

    handles = [h for b in blocks for h in (b.register_forward_pre_hook(start), b.register_forward_hook(stop),
                                           b.register_full_backward_pre_hook(start),
                                           b.register_full_backward_hook(stop))]
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=cuda):
            for _ in range(2):
                for m in marks:
                    m.clear()
                run_step().backward()
        if on_cuda:
            torch.cuda.synchronize()
    finally:
        for handle in handles:
            handle.remove()
        model.zero_grad(set_to_none=True)
    return [sum(_elapsed(a, b) for a, b in zip(m[::2], m[1::2], strict=True)) for m in marks]


def _elapsed(start: Any, stop: Any) -> float:
    if isinstance(start, torch.cuda.Event):
        return float(start.elapsed_time(stop)) / 1000.0  # milliseconds
    return float(stop - start)


def stage_bounds(counts: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, stop)`` block range of each stage from blocks-per-stage counts."""
    bounds, start = [], 0
    for count in counts:
        bounds.append((start, start + count))
        start += count
    return bounds


def balance(costs: Sequence[float], parts: int) -> list[int]:
    """Split ``costs`` into ``parts`` consecutive non-empty groups minimising the largest
    group sum (ties: earlier groups take fewer blocks).

    Returns:
        The number of blocks in each group.

    Raises:
        ValueError: more parts than costs.
    """
    n = len(costs)
    if parts > n:
        raise ValueError(f"cannot split {n} blocks into {parts} non-empty stages")
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    inf = float("inf")
    # best[k][i]: smallest bottleneck splitting the first i blocks into k groups.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                # Strictly better only: keeps the latest cut among ties, so early stages
                # (which also hold the embeddings) get fewer blocks.
                if value < best[k][i] - 1e-12 * max(1.0, abs(value)):
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def choose_partition(rule: str | Sequence[int], stages: int, params: Sequence[float],
                     times: Sequence[float] | None) -> list[int]:
    """Blocks per stage for a ``pipeline.partition`` rule.

    Args:
        rule: ``time``, ``params``, ``uniform`` or explicit block counts.
        stages: number of stages (ranks × virtual stages).
        params: each block's parameter count.
        times: each block's measured seconds (``time`` only).

    Raises:
        ValueError: more stages than blocks, or explicit counts that are not positive or
            do not add up to the number of blocks.
    """
    n = len(params)
    if stages > n:
        raise ValueError(f"pipeline of {stages} stages but the model has {n} blocks; use at most {n} stages")
    if not isinstance(rule, str):
        if any(c < 1 for c in rule) or sum(rule) != n:
            raise ValueError(f"pipeline.partition {rule} must be positive block counts adding up to the "
                             f"model's {n} blocks")
        return list(rule)
    if rule == "uniform":
        base, extra = divmod(n, stages)
        return [base + (1 if s >= stages - extra else 0) for s in range(stages)]
    costs = times if rule == "time" and times is not None else params
    return balance(costs, stages)
