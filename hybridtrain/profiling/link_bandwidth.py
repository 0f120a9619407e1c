"""How fast this machine's host⇄device link moves bytes: pinned copies each way and both at once.

Offload and streaming move weights up and gradients down every step; the planner divides
those bytes by the link's bandwidth. A datasheet gives the signalling rate, not what a
large pinned ``cudaMemcpyAsync`` reaches on this board, so :func:`link_bandwidth` measures
it: host→device, device→host, and both directions together on two streams (a PCIe link is
full duplex, but a root complex or an IOMMU can make the pair slower than twice one way).

On a CPU the "device" is the same DRAM: the same code copies between two host buffers
(unpinned: pinning needs an accelerator), so the dry run exercises it.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache

import torch

GB = 1e9


@dataclass(frozen=True)
class LinkBandwidth:
    """Bytes/s of the fastest of a few timed passes (``bidirectional``: both directions' bytes
    over the time both took together)."""

    host_to_device: float
    device_to_host: float
    bidirectional: float
    nbytes: int
    pinned: bool

    def as_row(self) -> dict[str, float | int | bool]:
        """The GB/s fields of a ``part: link`` row."""
        return {"h2d_gb_s": self.host_to_device / GB, "d2h_gb_s": self.device_to_host / GB,
                "bidir_gb_s": self.bidirectional / GB, "bytes": self.nbytes, "pinned": self.pinned}


def _best(run: object, repeats: int, sync: object) -> float:
    best = float("inf")
    for _ in range(repeats):
        sync()  # type: ignore[operator]
        start = time.perf_counter()
        run()  # type: ignore[operator]
        sync()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best


def link_bandwidth(device: torch.device | str, nbytes: int = 256 * 2**20, repeats: int = 5) -> LinkBandwidth:
    """Measure the host⇄``device`` link with copies of ``nbytes`` (fastest of ``repeats``
    passes after one untimed pass).

    Raises:
        ValueError: ``nbytes`` or ``repeats`` below 1.
    """
    if nbytes < 1 or repeats < 1:
        raise ValueError(f"link_bandwidth: nbytes {nbytes} and repeats {repeats} must both be >= 1")
    device = torch.device(device)
    cuda = device.type == "cuda"
    pinned = cuda  # page-locked memory needs an accelerator; without it the copy is a DRAM copy
    up_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    down_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    up_dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    down_src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if cuda else (None, None)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def up() -> None:
        with torch.cuda.stream(streams[0]) if cuda else nullcontext():
            up_dst.copy_(up_src, non_blocking=True)

    def down() -> None:
        with torch.cuda.stream(streams[1]) if cuda else nullcontext():
            down_dst.copy_(down_src, non_blocking=True)

    def both() -> None:
        up()
        down()

    for run in (up, down, both):  # untimed: first-touch page faults, stream creation
        run()
    sync()
    return LinkBandwidth(nbytes / _best(up, repeats, sync), nbytes / _best(down, repeats, sync),
                         2 * nbytes / _best(both, repeats, sync), nbytes, pinned)


PROBE_BYTES = 64 * 2**20
"""Bytes per copy of the planner's probe: large enough to reach the link's plateau (a few MB
suffice on PCIe), short (about 10 ms on PCIe gen5)."""


@lru_cache(maxsize=1)
def probe_link_bandwidth() -> float:
    """This machine's link for the planner: the slower direction of a short
    :func:`link_bandwidth` on the current CUDA device (measured once per process)."""
    found = link_bandwidth(torch.device("cuda", torch.cuda.current_device()), PROBE_BYTES, repeats=3)
    return min(found.host_to_device, found.device_to_host)
