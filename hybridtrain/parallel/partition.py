"""Splitting a model's blocks into pipeline stages.

One profiling step (forward + backward of one micro-batch on the full model, before it is
split) tells us everything the split needs:

- each block's forward + backward time and parameter count (the costs to balance);
- the activation shape at every block boundary (what stages send each other);
- which modules outside the blocks run before them (embeddings → first stage) and after
  them (final norm, head → last stage); a parameter used on both sides (tied input/output
  embeddings) belongs to both end stages, whose gradients are then summed.

:func:`balance` is the classic contiguous min-max partition (torchgpipe's
``balance_by_time``): no stage's cost exceeds the optimum bottleneck.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

PRE, BLOCK, POST = "pre", "block", "post"


@dataclass
class BlockProfile:
    """What one profiling step measured.

    Attributes:
        times: forward + backward seconds of each block.
        params: parameter count of each block.
        boundary_shapes: shape (and dtype) of the hidden state entering block ``i`` for
            ``i < len(blocks)``, and leaving the last block at index ``len(blocks)``.
        phases: parameter name → where it is used outside the blocks (``pre``/``post``).
        tuple_output: whether blocks return tuples (hidden state first) instead of a tensor.
    """

    times: list[float]
    params: list[int]
    boundary_shapes: list[tuple[torch.Size, torch.dtype]]
    phases: dict[str, set[str]] = field(default_factory=dict)
    tuple_output: bool = False


def hidden_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The hidden state a block is called with: its first positional argument, or the
    ``hidden_states`` keyword (Hugging Face layers).

    Raises:
        TypeError: the block was called without a tensor in either place.
    """
    value = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(value, torch.Tensor):
        raise TypeError("a pipelined block must take its hidden state as the first argument or as "
                        f"hidden_states=, got {type(value).__name__}; set model.blocks to the right list")
    return value


def profile_blocks(model: nn.Module, blocks: Sequence[nn.Module], run_step: Callable[[], torch.Tensor],
                   timed: bool) -> BlockProfile:
    """Run ``run_step`` (forward of one micro-batch returning its loss) and its backward,
    recording block timings, boundary shapes and the phase of every outside parameter.

    Args:
        model: the whole model (not yet split).
        blocks: its blocks, in execution order.
        run_step: computes one micro-batch's loss with ``model``.
        timed: measure times (a warm-up step first, so allocation is not timed).

    Returns:
        The profile; gradients are cleared and the RNG state restored afterwards.
    """
    index = {id(b): i for i, b in enumerate(blocks)}
    block_params = {id(p) for b in blocks for p in b.parameters()}
    n = len(blocks)
    state: dict[str, Any] = {"phase": PRE, "tuple": False}
    shapes: list[tuple[torch.Size, torch.dtype]] = [(torch.Size(), torch.float32)] * (n + 1)
    fwd = [0.0] * n
    bwd = [0.0] * n
    module_phases: dict[int, set[str]] = {}
    handles: list[Any] = []

    def block_pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        i = index[id(module)]
        hidden = hidden_of(args, kwargs)
        shapes[i] = (hidden.shape, hidden.dtype)
        state["phase"] = BLOCK
        fwd[i] -= time.perf_counter()

    def block_post(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        i = index[id(module)]
        fwd[i] += time.perf_counter()
        if i == n - 1:
            state["tuple"] = isinstance(out, tuple)
            hidden = out[0] if isinstance(out, tuple) else out
            shapes[n] = (hidden.shape, hidden.dtype)
            state["phase"] = POST

    def backward_pre(module: nn.Module, grad_out: Any) -> None:
        bwd[index[id(module)]] -= time.perf_counter()

    def backward_post(module: nn.Module, grad_in: Any, grad_out: Any) -> None:
        bwd[index[id(module)]] += time.perf_counter()

    def outside_pre(module: nn.Module, args: tuple[Any, ...]) -> None:
        if state["phase"] != BLOCK:
            module_phases.setdefault(id(module), set()).add(state["phase"])

    for block in blocks:
        handles += [block.register_forward_pre_hook(block_pre, with_kwargs=True),
                    block.register_forward_hook(block_post, with_kwargs=True),
                    block.register_full_backward_pre_hook(backward_pre),
                    block.register_full_backward_hook(backward_post)]
    for module in model.modules():
        if any(id(p) not in block_params for p in module.parameters(recurse=False)):
            handles.append(module.register_forward_pre_hook(outside_pre))
    try:
        with torch.random.fork_rng(devices=[]):
            for _ in range(2 if timed else 1):
                state["phase"] = PRE
                fwd[:] = [0.0] * n
                bwd[:] = [0.0] * n
                run_step().backward()
    finally:
        for handle in handles:
            handle.remove()
        model.zero_grad(set_to_none=True)
    # A shared parameter's first name is the one state dicts use.
    names: dict[int, str] = {}
    for name, param in model.named_parameters():
        names.setdefault(id(param), name)
    phases: dict[str, set[str]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) not in block_params:
                phases.setdefault(names[id(param)], set()).update(module_phases.get(id(module), set()))
    counts = [sum(p.numel() for p in b.parameters()) for b in blocks]
    return BlockProfile([f + b for f, b in zip(fwd, bwd, strict=True)], counts, shapes, phases,
                        bool(state["tuple"]))


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


def choose_partition(rule: str | list[int], stages: int, profile: BlockProfile) -> list[int]:
    """Blocks per stage for a ``pipeline.partition`` rule.

    Args:
        rule: ``time``, ``params``, ``uniform`` or explicit block counts.
        stages: number of stages (ranks × virtual stages).
        profile: the measured costs.

    Raises:
        ValueError: more stages than blocks, or explicit counts that are not positive or
            do not add up to the number of blocks.
    """
    n = len(profile.params)
    if stages > n:
        raise ValueError(f"pipeline of {stages} stages but the model has {n} blocks; use at most {n} stages")
    if isinstance(rule, list):
        if any(c < 1 for c in rule) or sum(rule) != n:
            raise ValueError(f"pipeline.partition {rule} must be positive block counts adding up to the "
                             f"model's {n} blocks")
        return list(rule)
    if rule == "uniform":
        base, extra = divmod(n, stages)
        return [base + (1 if s >= stages - extra else 0) for s in range(stages)]
    costs = profile.times if rule == "time" else [float(c) for c in profile.params]
    return balance(costs, stages)
