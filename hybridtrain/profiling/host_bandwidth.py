"""How fast this host's memory streams, and what the host optimizer step costs in bytes.

The host Adam step of optimizer offload and layer streaming is memory-bound: for each fp32
parameter it reads the master weight, the gradient and both moments and writes the weight
and the moments back — :data:`ADAM_BYTES_PER_PARAM` bytes, a handful of flops. Its speed
limit is therefore the host's memory bandwidth, which varies threefold between machines
(one DDR4 channel per core on a laptop, twelve DDR5 channels on a server socket), so a fixed
figure in the planner is wrong somewhere. :func:`triad_bandwidth` measures it with STREAM's
triad done in place (``b += s * c`` over arrays far larger than the caches, with torch's
intra-op threads) — the access pattern of an in-place optimizer step — and benchmarks divide
the Adam step's bytes/s by it.
"""

from __future__ import annotations

import time
from functools import lru_cache

import torch

ADAM_BYTES_PER_PARAM = 28
"""Bytes one fp32 AdamW update streams: reads master, gradient, exp_avg, exp_avg_sq (16);
writes master, exp_avg, exp_avg_sq (12)."""

TRIAD_BYTES_PER_ELEMENT = 12
"""The in-place triad's traffic: two fp32 arrays read, one of them written back. In place,
as the optimizer writes its state, so no write-allocate read hides in the figure (an
out-of-place ``a = b + s*c`` moves 16 bytes while STREAM counts 12, which put torch's fused
AdamW at 1.5x "the bandwidth" on a 2-core sandbox; in place, 1.07-1.15x: two cores cannot
saturate DRAM with one stream pair, so on few cores the fraction can exceed 1)."""


def triad_bandwidth(numel: int = 64 * 2**20, repeats: int = 5) -> float:
    """Host memory bandwidth in bytes/s: the best of ``repeats`` in-place STREAM triads.

    Args:
        numel: fp32 elements per array (two arrays; the default, 256 MiB each, is far
            beyond most CPUs' last-level cache, so the figure is DRAM's, not a cache's).
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
    b.add_(c, alpha=3.0)  # first pass: page faults and lazy allocation are not bandwidth
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        b.add_(c, alpha=3.0)
        best = min(best, time.perf_counter() - start)
    return TRIAD_BYTES_PER_ELEMENT * numel / best


PROBE_NUMEL = 32 * 2**20
"""Elements per array of the planner's probe: 128 MiB each, beyond the last-level cache of
the CPUs we plan for, and short (three passes, about 0.1 s on a 16-core server)."""


@lru_cache(maxsize=1)
def probe_host_bandwidth() -> float:
    """This machine's host memory bandwidth for the planner: a short :func:`triad_bandwidth`
    (:data:`PROBE_NUMEL` elements, three passes), measured once per process."""
    return triad_bandwidth(PROBE_NUMEL, repeats=3)
