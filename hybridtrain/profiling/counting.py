"""One real training step, counted: FLOPs per module with forward and backward apart,
activation bytes saved per module, and the live tensor bytes over the step.

FLOPs come from ``torch.utils.flop_counter.FlopCounterMode`` (every matmul, attention and
convolution, as 2·m·n·k for a matmul), run twice over the same step: one counter sees
everything, the other only what runs inside autograd's backward, so backward is measured
(recomputation of checkpointed blocks included), never assumed to be twice the forward.
Counting slows the step down, so this step is not the one that is timed.

The modules reported are the ones a user reasons about: every repeated block, the
embeddings and the rest outside the blocks (final norm, head). Dispatch modes and
saved-tensor hooks are per thread: the forwards layer-major streaming runs in worker
threads join the counts (:mod:`hybridtrain.profiling.thread_flops`,
:mod:`hybridtrain.runtime.thread_counters`), so FLOPs, their modules and saved bytes are
the same as without streaming.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.utils.flop_counter import flop_registry

from hybridtrain.models.blocks import BlocksNotFoundError, find_block_lists
from hybridtrain.parallel.gradient_sync import local
from hybridtrain.profiling.attention_flops import ATTENTION_FLOP_FORMULAS, raw_formula
from hybridtrain.profiling.memory import SavedTensorMeter
from hybridtrain.profiling.thread_flops import ThreadFlopCounter, ThreadModuleTracker, tracked_name
from hybridtrain.runtime.memory_limit import LiveTensorBytes
from hybridtrain.runtime.step_parts import PartClock


@dataclass
class ModuleCount:
    """What one module costs in one step (all micro-batches).

    Attributes:
        name: dotted name in the model (``transformer.h.3``).
        kind: ``block``, ``embedding`` or ``head`` (everything else outside the blocks).
        params: parameters it owns (tied weights count at their first owner).
        forward_flops / backward_flops: counted FLOPs of the step.
        saved_bytes: activation bytes autograd saved for its backward, per micro-batch
            (parameters excluded; blocks that checkpointing or swapping handle save
            through those techniques instead and show what is left on the device).
    """

    name: str
    kind: str
    params: int
    forward_flops: int = 0
    backward_flops: int = 0
    saved_bytes: int = 0


@dataclass
class StepCount:
    """The counted step (see the module docstring).

    Attributes:
        modules: the blocks, embeddings and head, in model order.
        forward_flops / backward_flops: the whole step's FLOPs (modules and the rest: loss).
        peak_live_bytes: the most tensor bytes alive on the device at once.
        timeline: ``(seconds, live bytes)`` through the step.
        parts: ``(seconds, part)`` each time the innermost step part changed (None: none).
        loss: the step's loss.
    """

    modules: list[ModuleCount]
    forward_flops: int
    backward_flops: int
    peak_live_bytes: int
    timeline: list[tuple[float, int]] = field(default_factory=list)
    parts: list[tuple[float, str | None]] = field(default_factory=list)
    loss: float = 0.0


def profiled_modules(model: nn.Module) -> list[tuple[str, str, nn.Module]]:
    """``(name, kind, module)`` of every block and of each module outside the blocks that
    owns parameters itself (embeddings, final norm, head), in model order."""
    try:
        lists = find_block_lists(model)
    except BlocksNotFoundError:
        lists = []
    blocks = {f"{path}.{i}" if path else str(i): block for path, blocks in lists for i, block in enumerate(blocks)}
    inside = tuple(f"{path}." if path else "" for path, _ in lists)
    found: list[tuple[str, str, nn.Module]] = []
    for name, module in model.named_modules():
        if name in blocks:
            found.append((name, "block", module))
        elif not (inside and any(name.startswith(p) for p in inside) or name in {p for p, _ in lists}) \
                and any(True for _ in module.parameters(recurse=False)):
            found.append((name or type(model).__name__, "embedding" if isinstance(module, nn.Embedding) else "head",
                          module))
    return found


def _backward_only(counter: ThreadModuleTracker) -> dict[Any, Any]:
    """A flop-formula table that counts only inside autograd's backward."""

    def only_backward(formula: Callable[..., int]) -> Callable[..., int]:
        def count(*args: Any, **kwargs: Any) -> int:
            return formula(*args, **kwargs) if counter.is_bw else 0

        return raw_formula(count)

    return {op: only_backward(formula) for op, formula in {**flop_registry, **ATTENTION_FLOP_FORMULAS}.items()}


def _module_flops(counts: dict[str, dict[Any, int]], wanted: set[str]) -> dict[str, int]:
    """FLOPs per module name from a counter's table."""
    out: dict[str, int] = {}
    for key, ops in counts.items():
        name = tracked_name(key, wanted)
        if name in wanted:
            out[name] = out.get(name, 0) + sum(ops.values())
    return out


def count_step(engine: Any, batch: Any, model: nn.Module | None = None) -> StepCount:
    """Run one ``engine.train_batch(batch)`` (a real step: the model trains) and count it.

    Args:
        engine: a :class:`hybridtrain.engine.Engine`.
        batch: the step's batch.
        model: whose modules to report (default ``engine.module``).
    """
    model = model if model is not None else engine.module
    modules = profiled_modules(model)
    owner: dict[int, str] = {}
    rows: list[ModuleCount] = []
    for name, kind, module in modules:
        own = [p for p in module.parameters() if id(p) not in owner]
        owner.update({id(p): name for p in own})
        rows.append(ModuleCount(name, kind, sum(p.numel() for p in own)))
    params = frozenset(local(p).untyped_storage().data_ptr() for p in model.parameters())
    wanted = {row.name for row in rows}
    blocks = {row.name for row in rows if row.kind == "block"}
    tracker = ThreadModuleTracker(unit=lambda key: tracked_name(key, wanted) in blocks)
    # torch's table lacks the CPU flash-attention kernels and, before torch 2.13, refuses
    # grouped key/value heads (Hugging Face's Llama family): ours handle both.
    everything = ThreadFlopCounter(tracker, ATTENTION_FLOP_FORMULAS)
    backward = ThreadFlopCounter(tracker, _backward_only(tracker))

    def running() -> Iterable[str]:
        # What forward leaves for backward; a recomputation inside backward is not that.
        if everything.mod_tracker.is_bw:
            return ()
        return (tracked_name(key, wanted) for key in everything.mod_tracker.parents)

    saved = SavedTensorMeter(owners=running, skip_storages=params)
    start = time.perf_counter()
    marks: list[tuple[float, str | None]] = []

    def switched(left: str | None) -> None:
        if left == "forward":  # a micro-batch's saved tensors are freed by its backward
            saved.new_window()
        marks.append((time.perf_counter() - start, clock.current))

    clock = PartClock(on_switch=switched)
    micro_batches = engine.options.batch.accumulation_steps
    with LiveTensorBytes(engine.device, record_timeline=True) as live, clock.running(), everything, backward, saved:
        loss = engine.train_batch(batch)
    total = _module_flops(everything.get_flop_counts(), wanted)
    back = _module_flops(backward.get_flop_counts(), wanted)
    for row in rows:
        row.backward_flops = back.get(row.name, 0)
        row.forward_flops = total.get(row.name, 0) - row.backward_flops
        row.saved_bytes = saved.by_owner.get(row.name, 0) // micro_batches
    step_total, step_backward = everything.get_total_flops(), backward.get_total_flops()
    return StepCount(
        modules=rows, forward_flops=step_total - step_backward, backward_flops=step_backward,
        peak_live_bytes=live.peak_bytes, timeline=list(live.timeline),
        parts=marks, loss=float(loss),
    )
