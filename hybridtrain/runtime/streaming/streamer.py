"""Layer-to-layer streaming (L2L): the blocks live in host memory and pass through the
device one (plus ``prefetch_blocks``) at a time; each block's host update runs as soon as
its gradients are complete.

::

    forward    pre-hook(i): wait upload(i), upload(i+1..i+p) ─► block i ─► post-hook: free i
    backward   grad of block i's output ready: wait upload(i), upload(i-1..i-p)
               block i's parameter gradients all accumulated (and, with frozen weights
               in it, the gradients of its inputs): D2H grads, free i,
               host worker: accumulate, [eager] fused CPU step of block i
    resident   embeddings, final norm, head (and blocks listed in ``resident``) stay on the
               device; their optimizer state is offloaded like optimizer offload

A block's weights are one flat host buffer (pinned, the fp32 master the optimizer
updates) and one flat device buffer whose *storage* is freed (``resize_(0)``) between
uses and re-filled before the next. Every tensor viewing it — including weight views that
autograd saved in forward — sees the restored data, so backward needs no special path.
Between uses the parameters' ``.data`` points at the host master, so ``state_dict`` and
checkpoints read (and load into) the masters directly.

Uploads are issued on a side stream after the compute work queued so far and the compute
stream waits for their event before the block runs: block i+1 copies while block i
computes. Device buffers are allocated and freed on the compute stream, so the caching
allocator never hands a buffer to new work before the kernels reading it have finished.

Under bf16/fp16, from the second training step, the parameters
:mod:`~hybridtrain.runtime.precision.half_width` picks (Linear weights the first step saw read once,
by a matmul) cross as half: each block uploads a byte image cast from the masters on a caster
thread at every forward upload (backward re-sends the same image; with ``images_per_upload``
the image is a pooled buffer, :mod:`~hybridtrain.runtime.streaming.streamed_block`, cast again
for backward), the parameters compute as half, and their half gradients land on the host,
which widens them exactly — the same bits as autocast casting fp32 weights on the device.

The last ``keep_blocks_for_backward`` blocks (the last one always) are not freed after
their forward: backward uploads nothing for them (its prefetch finds them loaded; block
N-K prefetches N-K-1), and each is freed when it lands. Micro-batch-major order keeps them
within each micro-batch (with all kept, 2 bytes up per half-width parameter per
micro-batch), layer-major within the step (per step). A forward without gradients keeps none.

Because everything is driven by module and autograd hooks, the engine's ordinary step
(micro-batches, accumulation, loss scaling, clipping) and its forward/backward/step trio
run unchanged; gradients reach the host optimizer through :class:`OffloadOptimizer`.
With ``layer_major`` a whole-step runner (:mod:`hybridtrain.runtime.streaming.layer_major`) sets
:attr:`LayerStreamer.driven` for the step, which silences the hooks, and calls
:meth:`~LayerStreamer.enter`, :meth:`~LayerStreamer.release` and :meth:`~LayerStreamer.offload_grads`
itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hybridtrain.compat import tree_leaves
from hybridtrain.runtime import transfer
from hybridtrain.runtime.device import normalize_device
from hybridtrain.runtime.offload.host_bytes import HostBytes
from hybridtrain.runtime.offload.optimizer import OffloadOptimizer
from hybridtrain.runtime.precision.half_width import WeightReads, matmul_reads_only
from hybridtrain.runtime.step_parts import step_part
from hybridtrain.runtime.streaming.residency import Residency
from hybridtrain.runtime.streaming.streamed_block import ImagePool, StreamedBlock


class LayerStreamer:
    """Streams ``blocks`` through ``device`` (see the module docstring).

    Args:
        blocks: the streamed blocks, in execution order.
        optimizer: an :class:`OffloadOptimizer` built with ``streamed`` = the blocks'
            parameter lists in the same order (bucket ``i`` is block ``i``).
        device: the compute device.
        prefetch_blocks: blocks uploaded ahead of the computing one.
        half_dtypes: parameters (by ``id``) that may cross and compute in a half type, from
            :func:`~hybridtrain.runtime.precision.half_width.half_width_params`; the first training
            step (moved in fp32) shows which of them the ops read once by a matmul, and
            only those cross in half afterwards.
        keep_blocks_for_backward: how many of the last blocks stay on the device from
            their forward to their backward, in either order (see :meth:`kept_for_backward`).
        images_per_upload: half-width images are cast into a few pooled host buffers at
            every upload (backward casts again) instead of kept per block (2 bytes per
            half-width parameter of host memory).

    Raises:
        HostMemoryError: the half-width images do not fit in available host memory.
    """

    def __init__(self, blocks: Sequence[nn.Module], optimizer: OffloadOptimizer, device: torch.device,
                 prefetch_blocks: int = 1,
                 half_dtypes: Mapping[int, torch.dtype] | None = None,
                 keep_blocks_for_backward: int = 0, images_per_upload: bool = False) -> None:
        self.device = normalize_device(device)
        self.optimizer = optimizer
        self.prefetch_blocks = prefetch_blocks
        self.keep_blocks_for_backward = keep_blocks_for_backward
        # The device buffers are resized in place, which live-byte counters see only when told.
        self.residency = Residency(buffer_of=lambda i: self.blocks[i].device_flat,
                                   unload=lambda i: self._free(self.blocks[i]))
        self.driven = False
        """True while a whole-step runner moves the blocks itself (the hooks stand aside)."""
        self._h2d = transfer.SideStream(device, "uploads")
        self._caster = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridtrain-cast")
        self._candidates = dict(half_dtypes or {})
        """What the structural rule allows to cross in half; the first training step
        (in fp32) shows which of those modules run once per forward (see :meth:`_decide`)."""
        self._observing = bool(self._candidates)
        # The blocks in flight, and one being cast: the pooled images' buffers.
        self._image_pool = ImagePool(prefetch_blocks + 2, optimizer.pin_memory, self.device) \
            if images_per_upload else None
        # Before any work: the images of every candidate (those kept fp32 later need none).
        images = [sum(p.numel() * self._candidates[id(p)].itemsize for p in block.parameters()
                      if id(p) in self._candidates) for block in blocks]
        transfer.check_host_memory((prefetch_blocks + 2) * max(images, default=0) if images_per_upload else sum(images),
                                   "half-width layer streaming (a half copy of each block's Linear weights)")
        self._not_half: set[int] = set()
        """Candidates the first step saw read twice, or by another op, or in a reused block."""
        self._in_backward = False
        self._half_modules: set[int] = set()
        self.blocks = [StreamedBlock(i, m, optimizer.buckets[i], device) for i, m in enumerate(blocks)]
        self._handles: list[RemovableHandle] = []
        for block in self.blocks:
            block.use_views(block.host_views)
            self._handles.append(block.module.register_forward_pre_hook(
                lambda _m, _a, b=block: self._forward_starts(b), prepend=True))
            self._handles.append(block.module.register_forward_hook(
                lambda _m, _a, _o, b=block: self._forward_ends(b), always_call=True))
            for module in block.module.modules():
                if matmul_reads_only(module) and any(id(p) in self._candidates for p in module.parameters()):
                    self._handles.append(module.register_forward_pre_hook(
                        lambda m, _a, b=block: self._linear_called(b, m)))
            self._handles.append(block.module.register_forward_pre_hook(
                lambda _m, args, kwargs, b=block: self._before_forward(b, args, kwargs), with_kwargs=True))
            self._handles.append(block.module.register_forward_hook(
                lambda _m, _a, out, b=block: self._after_forward(b, out)))
            for p in block.bucket.trained:
                self._handles.append(p.register_post_accumulate_grad_hook(lambda _p, b=block: self._grad_arrived(b)))
        transfer.note_cpu_offload(device, "layer streaming")

    def close(self) -> None:
        """Remove the hooks and drop the blocks' host and device views (an engine being
        replaced: its host masters must not outlive it through the model's hooks)."""
        self._caster.shutdown(wait=True)  # no cast may still write an image or queue a copy
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.blocks.clear()

    # ------------------------------------------------------------------ residency
    def _upload(self, block: StreamedBlock, backward: bool = False) -> None:
        if block.loaded:
            return
        # Allocated on the compute stream: its memory may be a just-freed block's, which
        # the copy stream must not overwrite before compute has finished reading it.
        block.device_flat.untyped_storage().resize_(block.nbytes)
        block.loaded = True
        self.residency.load(block.index)
        # A half-width image is cast at every forward upload, so whatever wrote the masters
        # since (the optimizer, a checkpoint load, the user) is what goes up; backward
        # reuses the forward's image (nothing writes a block's masters before it lands).
        cast = block.has_image and not (backward and block.image_current)
        # The block's update may still run on the host worker (a background step): the
        # upload follows it, and only this block's waits for it.
        block.update = block.bucket.unfinished_update
        if cast or block.update is not None:
            # The cast reads and writes host memory for every parameter: on the caster
            # thread, so the compute thread goes on queueing the current block's kernels.
            block.pending = self._caster.submit(self._cast_and_copy, block, transfer.compute_event(self.device),
                                                block.update, cast)
            return
        with step_part("transfer"), self._h2d.after_compute():
            self._copy(block)

    def _copy(self, block: StreamedBlock) -> None:
        """Queue the upload on the copy stream (entered by the caller)."""
        source = block.image if block.has_image and block.image is not None else block.bucket.flat_master
        block.device_flat.copy_(source, non_blocking=True)
        transfer.count_bytes("weights_up", block.nbytes)
        block.ready = self._h2d.record()
        block.sent(block.ready)

    def _cast_and_copy(self, block: StreamedBlock, after: torch.cuda.Event | None,
                       update: Future[None] | None = None, cast: bool = True) -> None:
        if update is not None:
            update.result()  # the masters are the step's result from here on
        # The current CUDA device is per thread: the copy stream's device must be ours.
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            if cast:
                block.cast()
            with self._h2d.after(after):  # after the compute work queued when it was asked for
                self._copy(block)

    def _arrived_upload(self, block: StreamedBlock, check: bool = True) -> None:
        """Wait for the caster to have queued ``block``'s upload (its ``ready`` event set)."""
        pending, block.pending = block.pending, None
        if pending is None:
            return
        update, block.update = block.update, None
        if update is not None:  # time spent waiting for the host update counts as such
            with step_part("host_optimizer"):
                futures.wait([update])
        with step_part("transfer"):
            error = pending.exception()
        if error is not None and check:
            raise error

    def _activate(self, block: StreamedBlock) -> None:
        self._upload(block)
        self._arrived_upload(block)
        transfer.compute_waits(block.ready, self.device)
        block.ready = None
        if not block.active:
            block.use_views(block.device_views)
            block.active = True

    def _free(self, block: StreamedBlock) -> None:
        if not block.loaded:
            return
        # A failed cast leaves nothing on the copy stream; the block is freed all the same.
        self._arrived_upload(block, check=False)
        # A prefetched block may be freed unused (a forward that skips it): its memory goes
        # back to the compute stream's pool, so that stream must not run past the upload.
        transfer.compute_waits(block.ready, self.device)
        block.ready = None
        block.use_views(block.host_views)
        block.active = False
        block.device_flat.untyped_storage().resize_(0)
        block.loaded = False
        self.residency.release(block.index)

    def enter(self, index: int, backward: bool = False) -> None:
        """Block ``index`` computes next: make its weights usable on the device and start
        uploading the ``prefetch_blocks`` blocks that follow it (preceding ones in backward)."""
        block = self.blocks[index]
        self._upload(block, backward)
        self._activate(block)
        step = -1 if backward else 1
        for i in range(index + step, index + step * (1 + self.prefetch_blocks), step):
            if 0 <= i < len(self.blocks):
                self._upload(self.blocks[i], backward)

    def release(self, index: int) -> None:
        """Free block ``index``'s device copy (its parameters point at the host master)."""
        self._free(self.blocks[index])

    def offload_grads(self, index: int) -> None:
        """Block ``index``'s gradients are complete: move them to the host, free its device
        copy, and let the host optimizer update it (at once, when the step allows)."""
        self.offload_given_grads(index, None)

    def offload_given_grads(self, index: int, grads: Sequence[torch.Tensor | None] | None) -> None:
        """:meth:`offload_grads` with ``grads`` (one per parameter) instead of the parameters' ``.grad``."""
        block = self.blocks[index]
        block.landed = True
        block.image_current = False  # the host step may now write the masters
        self.optimizer.offload_grads(index, then=lambda: self._free(block), grads=grads)

    def host_bytes(self) -> HostBytes:
        """Host memory of the streamed blocks and the host optimizer: its figures plus the
        blocks' half-width images (:mod:`~hybridtrain.runtime.offload.host_bytes`)."""
        kept = sum(b.kept_image_nbytes for b in self.blocks)
        return self.optimizer.host_bytes().with_images(kept, self._image_pool.nbytes if self._image_pool else 0)

    def kept_for_backward(self, index: int) -> bool:
        """Whether block ``index`` stays on the device from its forward to its backward (of
        the same micro-batch, or of the step under layer-major order): the last one always
        (backward starts with it), and the last ``keep_blocks_for_backward`` (those backward
        reaches first, after the shortest wait)."""
        return index >= len(self.blocks) - max(1, self.keep_blocks_for_backward)

    def half_width(self, index: int) -> list[bool]:
        """For each parameter of block ``index``: whether it computes (and its gradient
        arrives) in a half type."""
        block = self.blocks[index]
        return [dtype != block.bucket.flat_master.dtype for dtype in block.wire]

    # ------------------------------------------------------------------ hooks
    def _forward_starts(self, block: StreamedBlock) -> None:
        block.in_forward = True
        block.linear_calls.clear()
        if self._observing and torch.is_grad_enabled():
            if not (self.driven or self._in_backward):  # layer-major runs each block once per micro-batch
                block.forwards += 1
                if block.forwards > 1:  # a block reused in one forward sums its weights' gradients
                    self._not_half.update(id(p) for p in block.bucket.params)
            watched = {id(p) for p in block.bucket.params if id(p) in self._candidates}
            if watched:
                block.reads = WeightReads(watched)
                block.reads.__enter__()

    def _forward_ends(self, block: StreamedBlock) -> None:
        block.in_forward = False
        reads, block.reads = block.reads, None
        if reads is not None:
            reads.__exit__(None, None, None)
            self._not_half |= reads.other | {i for i, n in reads.uses.items() if n > 1}

    def _linear_called(self, block: StreamedBlock, module: nn.Module) -> None:
        # Two uses of a half weight in one graph would sum its gradients in half precision
        # (fp32 weights sum fp32 copies): not the plain loop's math. A recomputation in
        # backward (outside the block's own call) is no second use.
        if not (block.in_forward and torch.is_grad_enabled()):
            return
        calls = block.linear_calls.get(id(module), 0) + 1
        block.linear_calls[id(module)] = calls
        if calls > 1 and id(module) in self._half_modules:
            name = next((n for n, m in block.module.named_modules() if m is module), "?")
            raise RuntimeError(f"{type(module).__name__} {name or '(the block)'} of streamed block {block.index} "
                               "ran twice in one forward (once per forward in the first step, so it now computes "
                               "in bf16/fp16): its two half gradients would be summed in half precision; list the "
                               "block in layer_streaming.resident, or train without bf16/fp16")

    def _decide(self) -> None:
        """After the first training step (moved in fp32): the rule's candidates that every
        forward read once, by ``F.linear``/``addmm``, cross in half from now on; those read
        twice (a Linear called in a loop, a reused block, DoRA's ``lora_A``/``lora_B``, also
        run on an identity) or by other ops (DoRA's norm of the base weight) stay fp32."""
        self._observing = False
        half = {i: dtype for i, dtype in self._candidates.items() if i not in self._not_half}
        for block in self.blocks:
            block.set_wire(half, self.optimizer.pin_memory, self._image_pool)
        self._half_modules = {id(m) for block in self.blocks for m in block.module.modules()
                              if any(id(p) in half for p in m.parameters(recurse=False))}

    def _before_forward(self, block: StreamedBlock, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.driven:
            return
        self.enter(block.index)
        # A recomputation in backward finds the hook of the first forward in place.
        if block.frozen and not block.watching and torch.is_grad_enabled():
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
            if inputs:
                block.watching = True
                torch.autograd.graph.register_multi_grad_hook(
                    inputs, lambda _grads, b=block: self._grad_arrived(b), mode="all")

    def _after_forward(self, block: StreamedBlock, output: Any) -> None:
        if self.driven:
            return
        training = torch.is_grad_enabled()
        grads = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if training and grads:
            # Fires when the gradient of the block's output is ready: its backward is next.
            grads[0].register_hook(lambda g, b=block: self._before_backward(b))
        # The last block is the first one backward needs: keep it, and the kept ones (their
        # landing frees them after their backward, after_backward whatever is left).
        if not (training and grads and self.kept_for_backward(block.index)):
            self._free(block)

    def _before_backward(self, block: StreamedBlock) -> None:
        if not self.driven:
            self.enter(block.index, backward=True)

    def _grad_arrived(self, block: StreamedBlock) -> None:
        if self.driven:
            return
        block.arrived += 1
        if block.arrived == block.hooked + block.watching:
            # Every node that reads the weights has run.
            self.offload_grads(block.index)

    # ------------------------------------------------------------------ engine protocol
    def before_backward(self, final: bool, loss: torch.Tensor) -> None:
        """Engine hook before a micro-batch's backward (see :class:`BackwardObserver`)."""
        for block in self.blocks:
            block.arrived = 0
            block.landed = False
        self._in_backward = True
        self.optimizer.before_backward(final, loss)

    def after_backward(self, final: bool) -> None:
        """Engine hook after a micro-batch's backward: land and free what is left (blocks
        with unused parameters never complete through the hooks)."""
        for block in self.blocks:
            if not block.landed and any(p.grad is not None for p in block.bucket.params):
                self.offload_grads(block.index)
            self._free(block)
            block.watching = False
        self.optimizer.after_backward(final)
        self._in_backward = False
        for block in self.blocks:
            block.forwards = 0
        if final and self._observing:
            self._decide()  # nothing is on the device now

