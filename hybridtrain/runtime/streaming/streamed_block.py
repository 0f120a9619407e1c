"""One streamed block of layer streaming (:mod:`~hybridtrain.runtime.streaming.streamer`):
its device buffer and views, its upload event, and the byte *image* its half-width
parameters cross in — kept per block, or (``layer_streaming.half_images: per_upload``)
cast into one of a few pooled host buffers at every upload (:class:`ImagePool`), so the host
holds no 2-byte copy per streamed parameter."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future

import torch
from torch import nn

from hybridtrain.runtime import transfer
from hybridtrain.runtime.memory_limit import storage_resized
from hybridtrain.runtime.offload.bucket import Bucket
from hybridtrain.runtime.precision.half_width import WeightReads


class ImagePool:
    """Host buffers half-width images pass through on their way up, taken in turn: a buffer
    is cast into again only once its last upload has finished (its event), so ``count``
    buffers of the largest image bound the host memory whatever the model's depth.

    Args:
        count: buffers (the blocks in flight: the computing one, the prefetched ones, one more).
        pin: page-locked buffers (asynchronous uploads on CUDA).
        device: the compute device.
    """

    def __init__(self, count: int, pin: bool, device: torch.device) -> None:
        self.count = count
        self.pin = pin
        self.device = device
        self.image_nbytes = 0
        """Bytes of the largest image (set once the blocks are laid out)."""
        self._pooled: list[torch.Tensor | None] = [None] * count
        self._uploads: list[torch.cuda.Event | None] = [None] * count
        self._turn = 0

    def take(self, nbytes: int) -> tuple[int, torch.Tensor, torch.cuda.Event | None]:
        """The next buffer in turn (its first ``nbytes``), its slot and its last upload's event
        (to wait for before writing it). Called from one thread (the caster) only."""
        slot = self._turn
        self._turn = (slot + 1) % self.count
        buffer = self._pooled[slot]
        if buffer is None:
            buffer = self._pooled[slot] = transfer.host_buffer(self.image_nbytes, torch.uint8, self.pin, self.device)
        return slot, buffer[:nbytes], self._uploads[slot]

    def uploaded(self, slot: int, event: torch.cuda.Event | None) -> None:
        """The upload from ``slot``'s buffer is queued: its next writer waits for ``event``."""
        self._uploads[slot] = event

    @property
    def nbytes(self) -> int:
        """Host bytes of the buffers allocated so far."""
        return sum(b.nbytes for b in self._pooled if b is not None)


class StreamedBlock:
    """One block's device buffer, its views, and its upload event.

    With half-width parameters (see :mod:`~hybridtrain.runtime.precision.half_width`) the block
    crosses as a byte *image*: full-width parameters first, then the half ones (so every
    offset is a multiple of its element size), cast from the masters into a host buffer
    before the upload; the device buffer holds the same bytes, viewed per parameter.
    """

    def __init__(self, index: int, module: nn.Module, bucket: Bucket, device: torch.device) -> None:
        self.index = index
        self.module = module
        self.bucket = bucket
        self.device = device
        self.host_views = bucket.views(bucket.flat_master)
        self.set_wire({}, pin=False)
        self.image_current = False
        """The image holds the masters as they are (cast since the block last landed)."""
        self.image_read: torch.cuda.Event | None = None
        """The last upload from the image: it must finish before the image is cast again."""
        self.loaded = False
        self.active = False
        self.ready: torch.cuda.Event | None = None
        self.pending: Future[None] | None = None
        """The caster thread's cast and upload of the image, until the block is used or freed."""
        self.update: Future[None] | None = None
        """The block's background host update the pending upload follows."""
        self.arrived = 0
        self.landed = False
        self.hooked = len(bucket.trained)
        """Parameters whose gradient hooks count towards landing."""
        self.frozen = self.hooked < len(bucket.params)
        """Frozen weights (``requires_grad`` False) are read by backward without getting a
        gradient, so their block lands only once the gradients of its inputs exist too."""
        self.watching = False
        """A hook on this forward's input gradients counts as one more arrival."""
        self.in_forward = False
        """Inside the block's own forward call (not a recomputation in backward)."""
        self.linear_calls: dict[int, int] = {}
        """Calls of each half-width Linear (or Conv1D) in the block's current forward call."""
        self.reads: WeightReads | None = None
        """Watching how the block's forward reads its weights (the first training step)."""
        self.forwards = 0
        """The block's forward calls since the last backward (micro-batch-major order)."""

    def set_wire(self, half: Mapping[int, torch.dtype], pin: bool, pool: ImagePool | None = None) -> None:
        """Lay the block out for the device: parameters in ``half`` in that type (an image,
        kept per block, or taken from ``pool`` at each upload), the rest in the master's;
        only while the block is not on the device."""
        bucket, device, master = self.bucket, self.device, self.bucket.flat_master.dtype
        self.wire = [half.get(id(p), master) for p in bucket.params]
        """Each parameter's type on the device (its master's, or half)."""
        self.image: torch.Tensor | None = None
        self.image_views: list[torch.Tensor] = []
        self.pool: ImagePool | None = None
        self._slot = 0
        self.layout: list[tuple[int, int]] = []
        """Each parameter's byte offset and element count in the image."""
        self.image_nbytes = 0
        if any(dtype != master for dtype in self.wire):
            order = sorted(range(len(self.wire)), key=lambda j: -self.wire[j].itemsize)  # stable
            self.layout = [(0, 0)] * len(self.wire)
            offset = 0
            for j in order:
                self.layout[j] = (offset, bucket.params[j].numel())
                offset += bucket.params[j].numel() * self.wire[j].itemsize
            self.image_nbytes = offset
            if pool is None:
                self.image = transfer.host_buffer(offset, torch.uint8, pin, device)
                self.image_views = self._typed(self.image)
            else:
                self.pool = pool
                pool.image_nbytes = max(pool.image_nbytes, offset)
            self.device_flat = torch.empty(offset, dtype=torch.uint8, device=device)
            self.device_views = self._typed(self.device_flat)
        else:
            self.device_flat = torch.empty(bucket.flat_master.numel(), dtype=master, device=device)
            self.device_views = bucket.views(self.device_flat)
        self.nbytes = self.device_flat.untyped_storage().nbytes()
        self.device_flat.untyped_storage().resize_(0)
        storage_resized(self.device_flat, f"the release of streamed block {self.index}")

    @property
    def has_image(self) -> bool:
        """Whether the block crosses as an image (some parameter in half)."""
        return bool(self.layout)

    @property
    def kept_image_nbytes(self) -> int:
        """Host bytes of an image kept for this block between uses (0 when pooled or none)."""
        return self.image.nbytes if self.image is not None and self.pool is None else 0

    def _typed(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[start:start + numel * dtype.itemsize].view(dtype).view(p.shape)
                for (start, numel), dtype, p in zip(self.layout, self.wire, self.bucket.params, strict=True)]

    def cast(self) -> None:
        """Write the masters into the image, half ones rounded as autocast would on the device
        (into the next pooled buffer, with a pool)."""
        if self.pool is not None:
            self._slot, self.image, self.image_read = self.pool.take(self.image_nbytes)
            self.image_views = self._typed(self.image)
        assert self.image is not None
        transfer.host_waits(self.image_read)  # a non-blocking upload may still read the image
        with torch.no_grad():
            for image, master in zip(self.image_views, self.host_views, strict=True):
                image.copy_(master)
        self.image_current = self.pool is None  # a pooled buffer goes on to other blocks

    def sent(self, event: torch.cuda.Event | None) -> None:
        """The upload from the image is queued (``event``): the image's next writer waits for it."""
        self.image_read = event
        if self.pool is not None:
            self.pool.uploaded(self._slot, event)

    def use_views(self, views: Sequence[torch.Tensor]) -> None:
        for p, view in zip(self.bucket.params, views, strict=True):
            p.data = view
