"""How fast this host's memory streams, and what the host optimizer step costs in bytes.

The host Adam step of optimizer offload and layer streaming is memory-bound: for each fp32
parameter it reads the master weight, the gradient and both moments and writes the weight
and the moments back — :data:`ADAM_BYTES_PER_PARAM` bytes, a handful of flops. Its speed
limit is therefore the host's memory bandwidth, which varies threefold between machines
(one DDR4 channel per core on a laptop, twelve DDR5 channels on a server socket), so a fixed
figure in the planner is wrong somewhere. :func:`triad_bandwidth` measures it the way
STREAM's triad does (``a = b + s * c`` over arrays far larger than the caches, with torch's
intra-op threads), and benchmarks divide the Adam step's bytes/s by it.
"""

from __future__ import annotations

import time

import torch

ADAM_BYTES_PER_PARAM = 28
"""Bytes one fp32 AdamW update streams: reads master, gradient, exp_avg, exp_avg_sq (16);
writes master, exp_avg, exp_avg_sq (12)."""

TRIAD_BYTES_PER_ELEMENT = 12
"""STREAM's count for the triad: two fp32 arrays read, one written (write-allocate traffic
is not counted, as STREAM does not count it)."""


def triad_bandwidth(numel: int = 64 * 2**20, repeats: int = 5) -> float:
    """Host memory bandwidth in bytes/s: the best of ``repeats`` STREAM triads.

    Args:
        numel: fp32 elements per array (three arrays; the default, 256 MiB each, is far
            beyond any CPU's last-level cache, so the figure is DRAM's, not a cache's).
        repeats: timed passes after one that touches every page; the fastest counts, as
            STREAM reports it.

    Returns:
        ``TRIAD_BYTES_PER_ELEMENT * numel / seconds`` of the fastest pass, at the
        current ``torch.get_num_threads()``.

    Raises:
        ValueError: ``numel`` or ``repeats`` below 1.
    """
    if numel < 1 or repeats < 1:
        raise ValueError(f"triad_bandwidth: numel {numel} and repeats {repeats} must both be >= 1")
    b = torch.rand(numel)
    c = torch.rand(numel)
    a = torch.empty(numel)
    torch.add(b, c, alpha=3.0, out=a)  # first touch: page faults are not bandwidth
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        best = min(best, time.perf_counter() - start)
    return TRIAD_BYTES_PER_ELEMENT * numel / best
