"""Optimizer offload's updated weights sent to the device in half where that is exact.

Under bf16/fp16 autocast a Linear's weight is read by the forward only through autocast's
cast to half (:mod:`~hybridtrain.runtime.precision.half_width`). After a host update, sending the
master's half rounding instead of the fp32 master halves the bytes up (2 per parameter
instead of 4) and changes nothing the forward computes: the device widens the half copy
into the fp32 parameter exactly, and autocast's cast of that gives back the same half
bits (both casts round to nearest even). So the device parameter keeps its type and
shape (code that reads ``weight.dtype`` is unaffected) and holds ``fp32(half(master))``.

Which weights, decided from what each step's backward graphs show
(:func:`~hybridtrain.runtime.precision.half_width.graph_uses`): a candidate (the rule's, host-updated,
landed once per backward) goes up in half after a step whose every backward read it, and
only through casts (a Linear called twice casts its weight twice, to the same bits);
otherwise in fp32, which also makes it exact again. A later forward that reads a rounded
weight any other way (an op on the fp32 weight, a regularizer in the loss) would have
computed with the rounding: that step
is refused before anything is updated (:class:`HalfWidthReadError`).

Reading the weights stays exact: the model's ``state_dict`` first waits for updates still
running in the background (``overlap_updates``), then gives the host masters for
rounded weights (so checkpoints, ``model_state_dict`` and Hugging Face's
``save_pretrained`` save the masters); loading a weight through ``load_state_dict``
makes it exact; :meth:`HalfUploads.exact` sends the fp32 masters of all rounded weights
(the engine's ``settle``, before a checkpoint is loaded in place, and when the optimizer
closes). A reader that goes straight to ``param`` between steps without those sees the
rounding.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hybridtrain.runtime import transfer
from hybridtrain.runtime.offload.bucket import Bucket

STAGING_BUFFERS = 2
"""Host half buffers for uploads, each the size of the largest bucket (a bucket's cast
into one while the other's upload runs); counted by the optimizer's host memory check."""


class HalfWidthReadError(RuntimeError):
    """A weight sent to the device in half is read by a later forward in another way."""


class HalfUploads:
    """Which of optimizer offload's weights go up in half, and their readers kept exact.

    Inactive (everything goes up in fp32) until :meth:`attach` has given it the model,
    whose ``state_dict`` it must keep exact.

    Args:
        candidates: ids of host-updated parameters autocast reads only in half, with
            that half type (the optimizer's narrowable ones).
        pin_memory: page-locked staging buffers (asynchronous uploads on CUDA).
        device: the compute device.
    """

    def __init__(self, candidates: Mapping[int, torch.dtype], pin_memory: bool, device: torch.device) -> None:
        self.candidates = dict(candidates)
        self.pin_memory = pin_memory
        self.device = device
        self.rounded: set[int] = set()
        """Parameters whose device value is the half rounding of their master."""
        self._half: dict[int, torch.dtype] = {}
        """The candidates this step's updates send in half."""
        self._once: set[int] = set()
        self._other: set[int] = set()
        self._fresh = True
        self._names: dict[int, str] = {}
        self._masters: dict[int, torch.Tensor] = {}
        self._params: dict[int, nn.Parameter] = {}
        self._staging: list[tuple[torch.Tensor | None, torch.cuda.Event | None]] = [(None, None)] * STAGING_BUFFERS
        """Host half buffers the uploads take in turn, each with the event of its last upload."""
        self._turn = 0
        self._hooks: list[RemovableHandle] = []
        self.active = False
        """Whether any weight may go up in half (attached to a model with candidates)."""

    def attach(self, model: nn.Module, buckets: Sequence[Bucket], settle: Callable[[], None]) -> None:
        """Keep ``model``'s ``state_dict`` the last step's result and start sending half:
        ``model.state_dict()`` first calls ``settle`` (the optimizer's: updates may still run
        in the background), the modules that own candidates give the masters of rounded
        weights and mark the weights their ``load_state_dict`` loads exact. ``buckets``: the
        optimizer's (each parameter's master)."""
        settle_ref = weakref.WeakMethod(settle)  # the model must not keep the optimizer alive
        self._hooks.append(model.register_state_dict_pre_hook(functools.partial(_settle_first, settle_ref)))
        if not self.candidates:
            return
        self.active = True
        self._masters = {id(p): m for b in buckets for p, m in zip(b.params, b.masters, strict=True)
                         if id(p) in self.candidates}
        me = weakref.ref(self)
        for module_name, module in model.named_modules():
            own = {name: p for name, p in module.named_parameters(recurse=False) if id(p) in self.candidates}
            if not own:
                continue
            self._names.update({id(p): f"{module_name}.{name}".lstrip(".") for name, p in own.items()})
            self._params.update({id(p): p for p in own.values()})
            self._hooks.append(module.register_state_dict_post_hook(functools.partial(_exact_entries, me, own)))
            self._hooks.append(module.register_load_state_dict_pre_hook(functools.partial(_loaded, me, own)))

    def observe(self, read: set[int], other: set[int], final: bool) -> None:
        """A backward is about to run whose graph reads ``read`` and, among them, ``other``
        by an op that is not a cast (``final``: the step's last). After the final one, the
        step's half set is the candidates the step's backward passes read, only through casts.

        Raises:
            HalfWidthReadError: this forward read a weight that went up in half otherwise.
        """
        wrong = self.rounded & other
        if wrong:
            name = self._names.get(min(wrong), "?")
            raise HalfWidthReadError(
                f"parameter {name} went to the device in half after the last step (every forward until then read "
                "it only through autocast's cast to half), but this step also reads it in fp32 (an op on the weight "
                "itself, or a term of the loss); it computed with the rounding, so the step is refused before "
                "any update. Train without bf16/fp16 autocast, or without offload_optimizer, to read it this way")
        if self._fresh:
            self._once, self._other = set(), set()
        self._once |= read & self.candidates.keys()
        self._other |= other
        self._fresh = final
        if final:
            self._half = {i: self.candidates[i] for i in self._once - self._other} if self.active else {}

    @property
    def staging_bytes(self) -> int:
        """Host bytes of the half staging buffers allocated so far (at most ``STAGING_BUFFERS``)."""
        return sum(buffer.nbytes for buffer, _ in self._staging if buffer is not None)

    def bytes_up(self, bucket: Bucket) -> int:
        """Bytes an upload of ``bucket``'s weights sends."""
        return sum(p.numel() * (self._half[id(p)].itemsize if id(p) in self._half else p.element_size())
                   for p in bucket.params)

    def send(self, bucket: Bucket) -> None:
        """Copy ``bucket``'s masters into its device parameters, the half ones as half
        (cast on the host, widened on the device). Runs on the upload stream; call
        :meth:`sent` with the event that marks the copies."""
        staged: list[torch.Tensor] | None = None
        for j, (p, m) in enumerate(zip(bucket.params, bucket.masters, strict=True)):
            dtype = self._half.get(id(p))
            if dtype is None:
                p.data.copy_(m.detach(), non_blocking=True)
                self.rounded.discard(id(p))
                continue
            if staged is None:
                staged = self._staged(bucket, dtype)
            staged[j].copy_(m.detach())  # rounds to nearest even, as autocast's cast on the device does
            # Only the half copy crosses; widening it on the device is exact.
            p.data.copy_(staged[j].to(p.device, non_blocking=True))
            self.rounded.add(id(p))

    def sent(self, event: torch.cuda.Event | None) -> None:
        """``event`` marks the copies of the last :meth:`send`: the staging buffer it used
        is written again only after it."""
        buffer, _ = self._staging[self._turn]
        if buffer is not None:
            self._staging[self._turn] = (buffer, event)

    def _staged(self, bucket: Bucket, dtype: torch.dtype) -> list[torch.Tensor]:
        # The next buffer in turn: an upload may still read the other one (asynchronous
        # copies), so the host casts into this one while it runs.
        self._turn = (self._turn + 1) % STAGING_BUFFERS
        buffer, last = self._staging[self._turn]
        transfer.host_waits(last)  # the upload that last read it is done
        if buffer is None or buffer.dtype != dtype or buffer.numel() < bucket.numel:
            buffer = transfer.host_buffer(bucket.numel, dtype, self.pin_memory, self.device)
        self._staging[self._turn] = (buffer, None)
        return bucket.views(buffer[:bucket.numel])

    @torch.no_grad()
    def exact(self) -> None:
        """Send the fp32 masters of every rounded weight: afterwards the device parameters
        hold the exact weights (until an update sends half again). Call it when no upload
        is in flight (after the optimizer settled)."""
        for i in sorted(self.rounded):
            self._params[i].data.copy_(self._masters[i].detach())
        self.rounded.clear()

    def detach(self) -> None:
        """Remove the model's hooks and the staging buffers (the optimizer is closing)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.active = False
        self._staging = [(None, None)] * STAGING_BUFFERS
        self._masters.clear()
        self._params.clear()


def _settle_first(settle: weakref.WeakMethod[Callable[[], None]], *_: Any) -> None:
    """A ``state_dict`` pre-hook: wait for the optimizer's background updates."""
    live = settle()
    if live is not None:
        live()


def _exact_entries(uploads: weakref.ref[HalfUploads], own: dict[str, nn.Parameter], _module: nn.Module,
                   state_dict: dict[str, Any], prefix: str, _metadata: Any) -> None:
    """A ``state_dict`` post-hook: rounded weights are given as their host masters (a
    caller that asked for the parameters themselves, ``keep_vars``, gets them)."""
    live = uploads()
    if live is None:
        return
    for name, p in own.items():
        key = prefix + name
        if id(p) in live.rounded and key in state_dict and not isinstance(state_dict[key], nn.Parameter):
            state_dict[key] = live._masters[id(p)].detach()


def _loaded(uploads: weakref.ref[HalfUploads], own: dict[str, nn.Parameter], _module: nn.Module,
            state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """A ``load_state_dict`` pre-hook: a weight about to be loaded will be exact."""
    live = uploads()
    if live is not None:
        for name, p in own.items():
            if prefix + name in state_dict:
                live.rounded.discard(id(p))
