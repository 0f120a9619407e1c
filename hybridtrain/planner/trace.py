"""One training micro-batch of a model, traced on the meta device: live bytes and FLOPs
per phase (what runs before the blocks, each block, what runs after them).

Nothing is allocated: the model is built on the meta device and a micro-batch of the
real shape runs forward and backward there. Meta tensors have shapes, dtypes and
storages but no data, so the live-bytes counter the benchmark measures real steps with
(:class:`~hybridtrain.runtime.memory_limit.LiveTensorBytes`: one count per storage,
every aten op's outputs, forward and backward) follows meta storages exactly as it
follows CPU ones. Module hooks on the blocks mark where each phase's forward and
backward start and end.

Why the meta device and not fake tensors: ``torch._subclasses.fake_tensor`` is private
and changes with every torch release; the meta device, ``TorchFunctionMode``,
``FlopCounterMode``, saved-tensor hooks and module hooks are public, and the one dispatch
mode used is the measuring counter itself, so estimate and measurement count the same
thing. What neither sees is scratch space inside one kernel.

A trace runs several *passes* over the same micro-batch, each with every block treated
one way (plain, checkpointed, swapped, checkpointed with swapped inputs), so a plan that
mixes them (checkpoint every second block, swap some blocks) picks each block's profile
from the pass that treated it like the plan does. A second plain pass finds the first
one's gradients: later micro-batches of an accumulation window add to gradients instead
of creating them. :mod:`hybridtrain.planner.emulation` emulates autocast, flash
attention and swapping on the meta device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import flop_counter

from hybridtrain.compat import tree_flatten, tree_leaves, tree_unflatten
from hybridtrain.planner.emulation import FLOP_FORMULAS, MetaAutocast, Recompute, SwapEmulation
from hybridtrain.runtime.activations import is_kv_cache, tensor_call
from hybridtrain.runtime.batch import Batch, LossFn, compute_loss, run_model
from hybridtrain.runtime.memory_limit import LiveTensorBytes

PASSES = ("plain", "checkpoint", "swap", "swap_checkpoint")
"""How a pass treats every block: as is, checkpointed, swapped, checkpointed with its inputs swapped."""


@dataclass(frozen=True)
class PhaseProfile:
    """Bytes and FLOPs of one phase of a micro-batch (``pre``, a block, or ``post``).

    Byte figures are changes of the live bytes relative to the phase's start, so phases
    compose by adding them up in execution order.

    Attributes:
        name: ``pre``, the block's module path, or ``post`` (post includes the loss).
        input_bytes: its input activations (what a checkpoint keeps).
        output_bytes: its output activations.
        kept_bytes: live-bytes change from its forward's start to the next phase's start
            (tensors saved for backward plus its output, minus the input freed).
        forward_peak: highest live bytes above the start during its forward.
        nograd_peak: the same for a forward that saves nothing (a checkpoint's first pass).
        backward_peak / backward_end: highest live bytes above, and the change at the end
            of, its backward, on a micro-batch that finds no gradients.
        accumulate_peak / accumulate_end: the same when gradients are already there.
        param_bytes / param_numel: its own parameters.
        forward_flops / backward_flops: FLOPs of the micro-batch through it.
        host_bytes: activation bytes it sent to host memory (swapping, GPU target).
    """

    name: str
    input_bytes: int
    output_bytes: int
    kept_bytes: int
    forward_peak: int
    nograd_peak: int
    backward_peak: int
    backward_end: int
    accumulate_peak: int
    accumulate_end: int
    param_bytes: int
    param_numel: int
    forward_flops: float
    backward_flops: float
    host_bytes: int = 0


@dataclass(frozen=True)
class ModelTrace:
    """A micro-batch through the model, phase by phase (see the module docstring).

    Attributes:
        micro_batch: samples per micro-batch traced.
        compute_dtype: emulated autocast dtype (None = fp32).
        pre / blocks / post: the phases in forward order (blocks as they are).
        treated: the blocks' profiles in the other passes, by pass name.
        param_numel / param_bytes: the whole model's parameters.
        largest_param_numel: elements of the largest parameter (optimizer temporaries).
        batch_bytes: the micro-batch's input tensors.
        kernels: ops of one micro-batch's forward and backward that made a tensor (the
            fixed per-kernel cost of small micro-batches).
        param_tensors: parameter tensors (per-tensor optimizer kernels).
    """

    micro_batch: int
    compute_dtype: torch.dtype | None
    pre: PhaseProfile
    blocks: tuple[PhaseProfile, ...]
    post: PhaseProfile
    param_numel: int
    param_bytes: int
    largest_param_numel: int
    batch_bytes: int
    kernels: int
    param_tensors: int = 0
    treated: dict[str, tuple[PhaseProfile, ...]] = field(default_factory=dict)

    @property
    def phases(self) -> tuple[PhaseProfile, ...]:
        """Every phase in forward order."""
        return (self.pre, *self.blocks, self.post)

    def block(self, index: int, treatment: str = "plain") -> PhaseProfile:
        """Block ``index``'s profile under ``treatment`` (one of :data:`PASSES`)."""
        return self.blocks[index] if treatment == "plain" else self.treated[treatment][index]

    @property
    def flops(self) -> float:
        """Forward plus backward FLOPs of one micro-batch (no recomputation)."""
        return sum(p.forward_flops + p.backward_flops for p in self.phases)


def trace_model(model: nn.Module, blocks: list[nn.Module], block_names: list[str], micro: Batch,
                loss_fn: LossFn | None, compute_dtype: torch.dtype | None = None, target: str = "cpu",
                passes: tuple[str, ...] = (), swap_min_bytes: int = 1024) -> ModelTrace:
    """Trace a micro-batch through ``model`` on the meta device (see the module docstring).

    Args:
        model: built on the meta device (read; its ``.grad`` fields are cleared after).
        blocks / block_names: its blocks in execution order.
        micro: one micro-batch of the real shape, on the meta device.
        loss_fn: as the engine's.
        compute_dtype: autocast dtype to emulate (None = fp32).
        target: ``cpu`` or ``cuda``: whose autocast lists, and where swapped bytes live.
        passes: treatments besides ``plain`` to trace (see :data:`PASSES`).
        swap_min_bytes: ``activation_offload.min_bytes`` of the swap passes.
    """
    params = list(model.parameters())
    batch_bytes = sum(_nbytes(t) for t in tree_leaves(micro) if isinstance(t, torch.Tensor))
    counters = (flop_counter.FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS),
                flop_counter.FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS))
    autocast = MetaAutocast(compute_dtype, target)
    skip = {id(t.untyped_storage()) for t in (*params, *model.buffers())}
    runs: dict[str, _Pass] = {}
    try:
        with LiveTensorBytes("meta", record_timeline=True) as live:
            first = _one_micro_batch(model, blocks, micro, loss_fn, live, autocast, counters)
            second = _one_micro_batch(model, blocks, micro, loss_fn, live, autocast, None)
            peaks = [_nograd_peak(block, make, live, autocast)
                     for block, make in zip(blocks, first.inputs, strict=True)]
            for treatment in passes:
                for p in params:
                    p.grad = None
                swap = SwapEmulation(target, swap_min_bytes, skip) if treatment.startswith("swap") else None
                with _treated(blocks, treatment, swap, autocast):
                    runs[treatment] = _one_micro_batch(model, blocks, micro, loss_fn, live, autocast, None)
                runs[treatment].host = [swap.host_bytes.get(i, 0) if swap else 0 for i in range(len(blocks))]
    finally:
        for p in params:
            p.grad = None
    forward_counts = counters[0].get_flop_counts()
    total_fwd = _total(forward_counts, "Global")
    total_bwd = _total(counters[1].get_flop_counts(), "Global")
    # The forward counter attributes FLOPs to modules; backward is split in the same shares.
    ratio = total_bwd / total_fwd if total_fwd else 2.0
    root = type(model).__name__
    block_fwd = [_total(forward_counts, f"{root}.{name}") for name in block_names]
    outside_fwd = max(0.0, total_fwd - sum(block_fwd))
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    outer = [p for p in params if id(p) not in in_blocks]
    n = len(blocks)

    def profile(run: _Pass, name: str, k: int, nograd_peak: int, own: list[nn.Parameter], fwd_flops: float,
                in_bytes: int, out_bytes: int, host: int = 0) -> PhaseProfile:
        # Later micro-batches change as much against the first as in the plain passes.
        acc_peak = run.backward[k][1] + second.backward[k][1] - first.backward[k][1]
        acc_end = run.backward[k][0] + second.backward[k][0] - first.backward[k][0]
        return PhaseProfile(
            name=name, input_bytes=in_bytes, output_bytes=out_bytes,
            kept_bytes=run.forward[k][0], forward_peak=run.forward[k][1], nograd_peak=nograd_peak,
            backward_peak=run.backward[k][1], backward_end=run.backward[k][0],
            accumulate_peak=acc_peak, accumulate_end=acc_end,
            param_bytes=sum(_nbytes(p) for p in own), param_numel=sum(p.numel() for p in own),
            forward_flops=fwd_flops, backward_flops=fwd_flops * ratio, host_bytes=host)

    def block_profiles(run: _Pass) -> tuple[PhaseProfile, ...]:
        return tuple(profile(run, block_names[i], i + 1, peaks[i], list(blocks[i].parameters()), block_fwd[i],
                             first.in_bytes[i], first.out_bytes[i], run.host[i] if run.host else 0)
                     for i in range(n))

    # The parameters outside the blocks (embeddings, final norm, head; tied or not) and
    # the FLOPs outside them (the head's matmul dominates) are booked to post.
    pre = profile(first, "pre", 0, first.forward[0][1], [], 0.0, batch_bytes, first.in_bytes[0] if n else 0)
    post = profile(first, "post", n + 1, first.forward[n + 1][1], outer, outside_fwd,
                   first.out_bytes[-1] if n else 0, 0)
    return ModelTrace(
        micro_batch=_batch_size(micro), compute_dtype=compute_dtype, pre=pre, blocks=block_profiles(first),
        post=post, param_numel=sum(p.numel() for p in params), param_bytes=sum(_nbytes(p) for p in params),
        largest_param_numel=max((p.numel() for p in params), default=0), batch_bytes=batch_bytes,
        kernels=first.kernels, param_tensors=len(params),
        treated={treatment: block_profiles(run) for treatment, run in runs.items()})


@contextmanager
def _treated(blocks: list[nn.Module], treatment: str, swap: SwapEmulation | None,
             autocast: MetaAutocast) -> Iterator[None]:
    """Every block under ``treatment`` for one pass. Checkpointing is emulated too (not
    ``torch.utils.checkpoint``): its recomputation runs inside backward, where torch
    function modes are not active, so the emulated autocast must be entered again there."""
    for i, block in enumerate(blocks):
        block.forward = _treated_forward(block, i, swap, autocast, recompute=treatment.endswith("checkpoint"))
    try:
        yield
    finally:
        for block in blocks:
            del block.forward


def _treated_forward(block: nn.Module, index: int, swap: SwapEmulation | None, autocast: MetaAutocast,
                     recompute: bool) -> Callable[..., Any]:
    forward = type(block).forward
    scope = swap.scope if swap is not None else _no_scope

    def treated(*args: Any, **kwargs: Any) -> Any:
        if not recompute:
            with scope(index):
                return forward(block, *args, **kwargs)
        # A Hugging Face KV cache is left out as the engine turns caches off when it
        # checkpoints (``plan.build.disable_caches``): recomputation would fill it again.
        inputs, run, rebuild = tensor_call(functools.partial(forward, block), args, kwargs, leave_out=is_kv_cache)
        with scope(index):
            outs = Recompute.apply(run, autocast, *inputs)
        del inputs
        return rebuild(outs)
    return treated


@contextmanager
def _no_scope(_index: int) -> Iterator[None]:
    yield


@dataclass
class _Pass:
    forward: list[tuple[int, int]]   # per phase (pre, blocks…, post): (kept, peak)
    backward: list[tuple[int, int]]  # per phase: (change at its end, peak)
    in_bytes: list[int]
    out_bytes: list[int]
    inputs: list[Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]]
    kernels: int
    host: list[int] = field(default_factory=list)


def _one_micro_batch(model: nn.Module, blocks: list[nn.Module], micro: Batch, loss_fn: LossFn | None,
                     live: LiveTensorBytes, autocast: MetaAutocast,
                     counters: tuple[flop_counter.FlopCounterMode, flop_counter.FlopCounterMode] | None) -> _Pass:
    n = len(blocks)

    def mark() -> int:
        return len(live.timeline) - 1
    entered: list[int | None] = [None] * n     # block i's forward starts
    left: list[int | None] = [None] * n        # block i's forward returned
    bwd_start: list[int | None] = [None] * n   # block i's output gradient exists
    bwd_done: list[int | None] = [None] * n    # block i's input gradient exists
    in_bytes, out_bytes = [0] * n, [0] * n
    inputs: list[Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]] = [lambda: ((), {})] * n
    hooks = []
    for i, block in enumerate(blocks):
        def pre_hook(_m: nn.Module, args: Any, kwargs: Any, i: int = i) -> None:
            entered[i] = mark()
            leaves, spec = tree_flatten((args, kwargs))
            tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
            in_bytes[i] = sum(_nbytes(t) for t in tensors if t.is_floating_point())
            inputs[i] = _fresh_inputs(leaves, spec)
            grads = [t for t in tensors if t.requires_grad]
            if grads:
                grads[0].register_hook(lambda g, i=i: _set(bwd_done, i, mark()))

        def post_hook(_m: nn.Module, _args: Any, output: Any, i: int = i) -> None:
            left[i] = mark()
            outs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
            out_bytes[i] = sum(_nbytes(t) for t in outs if t.is_floating_point())
            grads = [t for t in outs if t.requires_grad]
            if grads:
                grads[0].register_hook(lambda g, i=i: _set(bwd_start, i, mark()))
        hooks.append(block.register_forward_pre_hook(pre_hook, with_kwargs=True))
        hooks.append(block.register_forward_hook(post_hook))
    try:
        start = mark()
        autocast.enabled = True
        with autocast, counters[0] if counters else nullcontext():
            loss = compute_loss(run_model(model, micro), micro, loss_fn)
        forward_end = mark()
        autocast.enabled = False  # the engine autocasts the forward only
        with autocast, counters[1] if counters else nullcontext():
            loss.backward()
        del loss
        end = mark()
    finally:
        autocast.enabled = True
        for h in hooks:
            h.remove()
    timeline = [b for _, b in live.timeline]
    fwd = [m if m is not None else start for m in entered]
    last = left[-1] if n and left[-1] is not None else (fwd[-1] if n else start)
    # Block i runs from its entry to the next block's entry (its input is dropped in
    # between); the last one to its return; post from there to the loss.
    bounds = [start, *fwd, last, forward_end]
    forward = [_segment(timeline, bounds[k], bounds[k + 1]) for k in range(n + 2)]
    starts = [m if m is not None else forward_end for m in bwd_start]
    dones = [m if m is not None else end for m in bwd_done]
    backward = [_segment(timeline, dones[0] if n else forward_end, end)]
    backward += [_segment(timeline, starts[i], dones[i]) for i in range(n)]
    backward.append(_segment(timeline, forward_end, starts[-1] if n else end))
    # Every op output is one allocation and, later, one free: two timeline entries.
    return _Pass(forward, backward, in_bytes, out_bytes, inputs, (end - start) // 2)


def _fresh_inputs(leaves: list[Any], spec: Any) -> Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]:
    """A maker of new meta tensors shaped like a block's inputs (the other arguments as they were)."""
    shapes = [(t.shape, t.dtype, t.requires_grad) if isinstance(t, torch.Tensor) else None for t in leaves]

    def make() -> tuple[tuple[Any, ...], dict[str, Any]]:
        filled = [torch.empty(s[0], dtype=s[1], device="meta").requires_grad_(s[2]) if s else leaf
                  for leaf, s in zip(leaves, shapes, strict=True)]
        args, kwargs = tree_unflatten(filled, spec)
        return tuple(args), dict(kwargs)
    # Only the non-tensor arguments are held (the tensors would stay alive with the closure).
    leaves = [None if isinstance(t, torch.Tensor) else t for t in leaves]
    return make


def _nograd_peak(run: Callable[..., Any], make_inputs: Callable[[], tuple[tuple[Any, ...], dict[str, Any]]],
                 live: LiveTensorBytes, autocast: MetaAutocast) -> int:
    """Peak above its inputs of a block's forward that saves nothing (a checkpoint's)."""
    args, kwargs = make_inputs()
    start = len(live.timeline) - 1
    with torch.no_grad(), autocast:
        out = run(*args, **kwargs)
    peak = max(b for _, b in live.timeline[start:]) - live.timeline[start][1]
    del out, args, kwargs
    return peak


def _segment(timeline: list[int], start: int, stop: int) -> tuple[int, int]:
    """(change, peak above start) of the live bytes between two timeline marks."""
    stop = max(start, stop)
    return timeline[stop] - timeline[start], max(timeline[start:stop + 1]) - timeline[start]


def _set(marks: list[int | None], i: int, value: int) -> None:
    if marks[i] is None:
        marks[i] = value


def _total(counts: dict[str, dict[Any, int]], key: str) -> float:
    return float(sum(counts.get(key, {}).values()))


def _nbytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())


def _batch_size(micro: Batch) -> int:
    leaves = [t for t in tree_leaves(micro) if isinstance(t, torch.Tensor)]
    return int(leaves[0].shape[0]) if leaves and leaves[0].dim() else 1
