"""Which blocks' weights are materialised on the compute device, over time.

Layer streaming promises that at most ``prefetch_blocks + 1`` blocks occupy device memory
at once; this ledger is where that is counted (tests assert on it, the profiler reads it).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Residency:
    """Ledger of blocks on the device: ``load`` when a block's upload is issued,
    ``release`` when its device copy is freed."""

    on_device: set[int] = field(default_factory=set)
    peak: int = 0
    uploads: int = 0
    events: list[tuple[str, int]] = field(default_factory=list)
    keep_events: bool = False

    def load(self, block: int) -> None:
        """Block ``block``'s weights now take device memory."""
        self.on_device.add(block)
        self.uploads += 1
        self.peak = max(self.peak, len(self.on_device))
        if self.keep_events:
            self.events.append(("load", block))

    def release(self, block: int) -> None:
        """Block ``block``'s device copy was freed."""
        self.on_device.discard(block)
        if self.keep_events:
            self.events.append(("release", block))

    def reset_peak(self) -> None:
        """Start a new peak window (e.g. per step)."""
        self.peak = len(self.on_device)
        self.uploads = 0
        self.events.clear()
