"""Which blocks' weights are materialised on the compute device, over time.

Layer streaming promises that at most ``prefetch_blocks + 1`` blocks occupy device memory
at once (plus the ``keep_blocks_for_backward`` last ones, in either streaming order,
between their forward and their backward); this ledger is where that is counted (tests
assert on it, the profiler reads it). It also reports each block's device buffer, which
the streamer resizes in place where no dispatch mode sees it, to the live-byte counters of
:mod:`~hybridtrain.runtime.memory_limit`, so a CPU ``device_memory_limit`` counts (and
limits) the blocks on the device truthfully.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hybridtrain.runtime.memory_limit import DeviceMemoryLimitError, storage_resized


@dataclass
class Residency:
    """Ledger of blocks on the device: ``load`` when a block's upload is issued (its buffer
    just allocated), ``release`` when its device copy is freed.

    Attributes:
        buffer_of: each block's device buffer, reported to the live-byte counters at every
            load and release (None: nothing reported).
        unload: frees a block whose load a counter's limit refused, so that its owner's
            state says "not on the device" again before the error reaches the caller.
    """

    on_device: set[int] = field(default_factory=set)
    peak: int = 0
    uploads: int = 0
    events: list[tuple[str, int]] = field(default_factory=list)
    keep_events: bool = False
    buffer_of: Callable[[int], torch.Tensor] | None = None
    unload: Callable[[int], None] | None = None

    def load(self, block: int) -> None:
        """Block ``block``'s weights now take device memory.

        Raises:
            DeviceMemoryLimitError: the buffer takes a live-byte counter past its limit
                (the block was unloaded first).
        """
        if self.buffer_of is not None:
            try:
                storage_resized(self.buffer_of(block), f"the upload of streamed block {block}")
            except DeviceMemoryLimitError:
                if self.unload is not None:
                    self.unload(block)
                raise
        self.on_device.add(block)
        self.uploads += 1
        self.peak = max(self.peak, len(self.on_device))
        if self.keep_events:
            self.events.append(("load", block))

    def release(self, block: int) -> None:
        """Block ``block``'s device copy was freed."""
        self.on_device.discard(block)
        if self.buffer_of is not None:
            storage_resized(self.buffer_of(block), f"the release of streamed block {block}")
        if self.keep_events:
            self.events.append(("release", block))

    def reset_peak(self) -> None:
        """Start a new peak window (e.g. per step)."""
        self.peak = len(self.on_device)
        self.uploads = 0
        self.events.clear()
