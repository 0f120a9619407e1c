"""Activation swapping (vDNN): what autograd saves inside chosen blocks waits for backward
in host memory instead of device memory.

::

    forward   block 0     block 1     block 2          (compute stream)
                 └─D2H──┐    └─D2H──┐    └─D2H──┐      (copy stream; device copy freed
                        ▼           ▼           ▼       once the copy has read it)
    host      [acts 0]    [acts 1]    [acts 2]
                        ┌───────────┘  ┌──────┘
    backward  block 2 ◄─H2D(1)  block 1 ◄─H2D(0)  block 0
              while block k runs backward, block k-1's tensors (``prefetch_blocks``
              ahead) are already on their way back

A saved tensor is packed by a ``saved_tensors_hooks`` pack hook active only inside the
block's forward: it is copied into a (pinned) host buffer on a side stream after the
kernel that produced it (an event orders the streams) and ``record_stream`` keeps its
device memory from reuse until the copy has read it. When backward unpacks the first
tensor of a block, that block and the ``prefetch_blocks`` blocks before it are copied back
on another side stream; the compute stream waits for each tensor's copy event only when it
needs the tensor.

With activation checkpointing on a swapped block, only the block's inputs are saved (the
rest is recomputed in backward), so only they travel: :class:`_SwappedRecompute` is a
checkpoint whose inputs are saved with ``save_for_backward`` and therefore pass through
the pack hook. Parameters, buffers and small tensors are never swapped.

A device tensor's memory is reusable only once its copy has *run*, and the host enqueues
kernels far ahead of the device: on a fast GPU the copies would fall behind and the
device would end up holding nearly every activation anyway. So before a block's forward
starts, the host waits until the copies of the block ``copies_in_flight`` blocks back
have finished (vDNN's synchronisation): at most that many blocks' activations are on the
device at once, and the device still has the block in between queued, so it never
idles waiting for the host.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hybridtrain.runtime import stream_marks, transfer
from hybridtrain.runtime.activations.forward_wrap import wrap_forward
from hybridtrain.runtime.activations.recompute import tensor_call, without_kv_cache
from hybridtrain.runtime.device import normalize_device
from hybridtrain.runtime.step_parts import step_part

_ORIGINAL_FORWARD = "_hybridtrain_swap_original_forward"


@dataclass
class SwapStats:
    """What the swapper did (tests and the profiler read it)."""

    tensors_out: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    kept_on_device: int = 0
    prefetch_ahead: list[int] = field(default_factory=list)
    """For every block whose backward began: blocks already on their way back beyond it."""
    fetched_late: int = 0
    """Blocks whose backward began before any of their tensors was on its way back."""


class _Swapped:
    """A saved tensor's storage living in host memory (and, once prefetched, on its way
    back): the bytes of the whole storage, so views (a transposed bf16 weight cast, the
    q/k/v slices of one projection) travel once and come back as the same views."""

    __slots__ = ("host", "copied", "seq", "device_bytes", "ready", "views", "unpacked", "__weakref__")

    def __init__(self, host: torch.Tensor, copied: torch.cuda.Event | None, seq: int) -> None:
        self.host = host
        self.copied = copied
        self.seq = seq
        self.device_bytes: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None
        self.views = 0
        """Saved tensors viewing this storage; the device copy is kept until all are unpacked."""
        self.unpacked = 0


class _SwappedView:
    """One saved tensor: its layout over a swapped storage."""

    __slots__ = ("storage", "dtype", "offset", "size", "stride")

    def __init__(self, storage: _Swapped, tensor: torch.Tensor) -> None:
        self.storage = storage
        self.dtype = tensor.dtype
        self.offset = tensor.storage_offset()
        self.size = tensor.shape
        self.stride = tensor.stride()
        storage.views += 1


class ActivationSwapper:
    """Swaps the saved activations of wrapped blocks (see the module docstring).

    Args:
        device: the compute device.
        prefetch_blocks: blocks copied back ahead of the one whose backward starts.
        pin_memory: page-locked host buffers.
        min_bytes: smaller saved tensors stay where they are.
        copies_in_flight: blocks whose copies to the host may still be running when the
            next block's forward starts.
    """

    def __init__(self, device: torch.device, prefetch_blocks: int = 1, pin_memory: bool = True,
                 min_bytes: int = 1024, copies_in_flight: int = 2) -> None:
        # Compared with every saved tensor's device: "cuda" or "cpu:0" would match none.
        self.device = normalize_device(device)
        self.prefetch_blocks = prefetch_blocks
        self.pin_memory = pin_memory
        self.min_bytes = min_bytes
        self.stats = SwapStats()
        self._d2h = transfer.SideStream(device, "downloads")
        self._h2d = transfer.SideStream(device, "uploads")
        self._seq = 0
        self._pending: dict[int, list[weakref.ref[_Swapped]]] = {}
        self._prefetched: set[int] = set()
        self._current = 0
        self._order: dict[int, int] = {}
        self._last_scope: tuple[int, int] = (0, 0)
        self.copies_in_flight = copies_in_flight
        self._copied_out: dict[int, torch.cuda.Event | None] = {}

    # ------------------------------------------------------------------ wrapping
    def wrap(self, module: nn.Module, recompute: bool = False) -> None:
        """Swap ``module``'s saved activations (``recompute``: checkpoint it and swap only
        its inputs). The forward is wrapped in place, so parameter names stay."""
        run = self._recomputed_forward if recompute else self._swapped_forward
        wrap_forward(module, _ORIGINAL_FORWARD, functools.partial(run, module))

    def _swapped_forward(self, module: nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        with self._scope(module):
            return forward(*args, **kwargs)

    def _recomputed_forward(self, module: nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        inputs, run, rebuild = tensor_call(forward, args, without_kv_cache(module, kwargs))
        # A grad-requiring dummy input makes the outputs require grad even when no real
        # input does (the first block of an nn.Sequential), so parameters get gradients.
        dummy = torch.empty(0, requires_grad=True)
        with self._scope(module):
            outs = _SwappedRecompute.apply(run, self.device, dummy, *inputs)
        return rebuild(outs)

    # ------------------------------------------------------------------ hooks
    @contextmanager
    def _scope(self, module: nn.Module) -> Iterator[None]:
        self._seq += 1
        seq = self._seq
        self._pending = {k: v for k, v in self._pending.items() if any(r() is not None for r in v)}
        self._pending[seq] = []
        self._last_scope = (id(module), seq)
        skip = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
        # Keyed by storage address and holding the tensor until the block's forward ends
        # (an address could be reused by a new tensor once the swapped one is freed); no
        # pack happens after that, so the dict is emptied then.
        seen: dict[int, tuple[torch.Tensor, _Swapped]] = {}
        # Bound the device memory held by copies not yet run (see the module docstring).
        with step_part("transfer"):
            for old in [s for s in self._copied_out if s <= seq - self.copies_in_flight]:
                transfer.host_waits(self._copied_out.pop(old))
        try:
            with torch.autograd.graph.saved_tensors_hooks(
                    functools.partial(self._pack, seq, skip, seen), self._unpack):
                yield
        finally:
            if seen:
                self._copied_out[seq] = self._d2h.record()
            # Autograd keeps the pack hook (and so ``seen``) with every tensor it saved, until
            # backward: emptied, the dict no longer holds the device tensors it swapped out.
            seen.clear()

    def _pack(self, seq: int, skip: set[int], seen: dict[int, tuple[torch.Tensor, _Swapped]],
              tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage() if not tensor.is_sparse else None
        if (storage is None or tensor.device != self.device or storage.nbytes() == 0
                or storage.nbytes() < self.min_bytes or storage.data_ptr() in skip):
            self.stats.kept_on_device += 1
            return tensor
        # Whole storages travel, views included: a non-contiguous saved tensor (the bf16
        # cast of a weight that ``linear`` saves transposed when autocast's cache is off,
        # attention's q/k/v slices) would otherwise keep its storage on the device: for
        # weight casts, 2 bytes per parameter of every swapped or streamed block. The same
        # storage saved by several ops (or views) travels once.
        if storage.data_ptr() in seen:
            return _SwappedView(seen[storage.data_ptr()][1], tensor)
        flat = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)  # (nbytes,)
        host = transfer.host_empty(flat.numel(), torch.uint8, self.pin_memory, self.device)
        with step_part("transfer"), self._d2h.after_compute():
            host.copy_(flat, non_blocking=True)
            self._d2h.keep_alive(tensor)
            copied = self._d2h.record()
        transfer.count_bytes("activations_out", flat.numel())
        handle = _Swapped(host, copied, seq)
        seen[storage.data_ptr()] = (tensor, handle)
        self._pending[seq].append(weakref.ref(handle))
        self.stats.tensors_out += 1
        self.stats.bytes_out += flat.numel()
        return _SwappedView(handle, tensor)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        view: _SwappedView = packed
        handle = view.storage
        if handle.seq != self._current:
            self._begin_block(handle.seq)
        if handle.device_bytes is None:  # unpacked twice (retain_graph): copy again
            self._prefetch_one(handle)
        flat = handle.device_bytes
        assert flat is not None
        handle.unpacked += 1
        if handle.unpacked >= handle.views:  # the last view: the views now hold the memory
            handle.device_bytes, handle.unpacked = None, 0
        transfer.compute_waits(handle.ready, self.device)
        return torch.empty(0, dtype=view.dtype, device=flat.device).set_(
            flat.untyped_storage(), view.offset, view.size, view.stride)

    def last_scope(self, module: nn.Module) -> int | None:
        """The swap scope of ``module``'s forward that just ran (None if another ran since)."""
        owner, seq = self._last_scope
        return seq if owner == id(module) else None

    def expect_backward_order(self, scopes: Sequence[int]) -> None:
        """The order in which the coming backward visits the swap ``scopes`` (from
        :meth:`last_scope`); without it, the reverse of forward order is assumed. A
        layer-major step runs every micro-batch through one block before the next, which
        is not that order, and prefetching must follow what actually comes next."""
        self._order = {seq: k for k, seq in enumerate(scopes)}

    def _begin_block(self, seq: int) -> None:
        """Backward reached block ``seq``: bring it and the ``prefetch_blocks`` next ones back."""
        self._current = seq
        live = {*self._pending, *self._prefetched} - {seq}
        if seq in self._order:
            here = self._order[seq]
            upcoming = sorted((s for s in live if self._order.get(s, -1) > here), key=self._order.__getitem__)
        else:
            upcoming = sorted((s for s in live if s < seq), reverse=True)
        if self._pending.get(seq) and seq not in self._prefetched:
            self.stats.fetched_late += 1
        self._prefetched = {s for s in self._prefetched if s in upcoming}
        for s in [seq, *upcoming[:self.prefetch_blocks]]:
            for ref in self._pending.pop(s, []):
                handle = ref()
                if handle is not None:
                    self._prefetch_one(handle)
            self._prefetched.add(s)
        self.stats.prefetch_ahead.append(len(self._prefetched - {seq}))

    def _prefetch_one(self, handle: _Swapped) -> None:
        # Allocated on the compute stream, which uses and frees it: memory from the copy
        # stream's pool would be a second pool the compute stream never reuses. The copy
        # waits for the compute work queued so far (the memory may be a just-freed tensor
        # that kernels still read) and for the copy to the host.
        flat = torch.empty(handle.host.numel(), dtype=torch.uint8, device=self.device)
        with step_part("transfer"), self._h2d.after_compute(), self._h2d.after(handle.copied):
            flat.copy_(handle.host, non_blocking=True)
            self._h2d.keep_alive(flat)
            handle.ready = self._h2d.record()
        handle.device_bytes = flat
        transfer.count_bytes("activations_in", flat.numel())
        self.stats.bytes_in += flat.numel()


class _SwappedRecompute(torch.autograd.Function):
    """Checkpoint whose inputs go through ``save_for_backward`` (and thus the swap hooks);
    the forward runs without grad and is recomputed in backward with the same RNG state
    and autocast settings, so dropout masks and precision match the plain run."""

    @staticmethod
    def forward(ctx: Any, run: Callable[..., tuple[torch.Tensor, ...]], device: torch.device,
                dummy: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.run = run
        ctx.device = device
        ctx.autocast = (torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))
        ctx.rng = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
        ctx.save_for_backward(*inputs)
        # Run as backward will recompute it: with grad, so that every kernel choice (SDPA
        # picks by whether its mask requires grad) and rounding match; nothing is kept.
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_discard, _nothing):
            outs = run(*[x.detach().requires_grad_(x.requires_grad) for x in inputs])
        results = tuple(o.detach() for o in outs)
        # Outputs that need no gradient in the plain run (T5's position bias) must not
        # require one here either: the next block's kernels choose by it.
        ctx.mark_non_differentiable(*[r for r, o in zip(results, outs, strict=True) if not o.requires_grad])
        return results

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        device: torch.device = ctx.device
        enabled, dtype = ctx.autocast
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [],
                                   device_type=device.type if device.type == "cuda" else "cuda"):
            torch.set_rng_state(ctx.rng[0])
            if ctx.rng[1] is not None:
                torch.cuda.set_rng_state(ctx.rng[1], device)
            # The weight-cast cache is off, as in the engine's forward (runtime/precision/scaling.py):
            # one cached cast shared by several ops would sum their gradients in low precision.
            with torch.enable_grad(), torch.autocast(device.type, dtype=dtype, enabled=enabled, cache_enabled=False), \
                    stream_marks.mark_compute("recomputation", device):
                outs = ctx.run(*inputs)
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, None, *[x.grad if x.requires_grad else None for x in inputs])


def _discard(_tensor: torch.Tensor) -> None:
    return None


def _nothing(_packed: None) -> torch.Tensor:
    raise RuntimeError("a swapped checkpoint's forward graph is never backwarded")


def params_in_several_backwards(model: nn.Module, recomputed: Sequence[nn.Module]) -> frozenset[int]:
    """Ids of parameters whose gradient arrives in more than one backward pass of a
    micro-batch: each block in ``recomputed`` runs a backward of its own (in
    :class:`_SwappedRecompute`), so a parameter shared by two of them, or by one of them and
    the rest of the model, accumulates twice — a gradient hook sees it complete too early."""
    contexts: dict[int, set[int]] = {}
    for k, block in enumerate(recomputed):
        for p in block.parameters():
            contexts.setdefault(id(p), set()).add(k)
    inside = {id(m) for block in recomputed for m in block.modules()}
    for module in model.modules():
        if id(module) not in inside:
            for p in module.parameters(recurse=False):
                contexts.setdefault(id(p), set()).add(-1)
    return frozenset(i for i, seen in contexts.items() if len(seen) > 1)


def apply_activation_offload(blocks: Sequence[nn.Module], device: torch.device, recompute: Sequence[nn.Module] = (),
                             prefetch_blocks: int = 1, pin_memory: bool = True,
                             min_bytes: int = 1024) -> ActivationSwapper:
    """Swap the saved activations of ``blocks``; those also in ``recompute`` are
    checkpointed with only their inputs swapped.

    Returns:
        The swapper (its ``stats`` say what moved).
    """
    swapper = ActivationSwapper(device, prefetch_blocks, pin_memory, min_bytes)
    again = {id(m) for m in recompute}
    for block in blocks:
        swapper.wrap(block, recompute=id(block) in again)
    transfer.note_cpu_offload(device, "activation offload")
    return swapper
