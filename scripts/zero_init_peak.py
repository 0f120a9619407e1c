"""Peak host memory per rank of ``deepspeed.initialize`` on a model built under ``zero.Init``
(hybridtrain's drop-in, ZeRO-3 with DeepSpeed's bf16 math): with the partitions kept through
``initialize`` (what the drop-in does) and with the model gathered whole first (what it did
before). Run on N processes, with glibc returning freed blocks to the system (else its dynamic
mmap threshold keeps them, and the resident size counts memory no tensor holds):
``MALLOC_MMAP_THRESHOLD_=65536 hybridtrain launch --nproc-per-node 2 scripts/zero_init_peak.py``.

Each rank resets its peak resident size (``/proc/self/clear_refs``) after the model is built and
reads it (``VmHWM``) after ``initialize``, so the figure is the peak above what the process held
with the model partitioned; construction under ``zero.Init`` is whole either way (the block partitions
when it ends). Linux only.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch
import torch.distributed as dist

import hybridtrain.deepspeed as deepspeed
from hybridtrain.deepspeed.runtime.zero import partitioning

CONFIG = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": float("inf"), "bf16": {"enabled": True},
          "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _resident(field: str) -> int:
    """``field`` (``VmRSS``, ``VmHWM``) of this process, in bytes."""
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    assert match is not None, field
    return int(match.group(1)) * 1024


def initialize_peak(layers: int, width: int, keep_partitions: bool) -> tuple[int, int]:
    """Build ``layers`` Linear(width, width) under ``zero.Init``, initialize; returns (peak bytes
    above the resident size before ``initialize``, the model's fp32 bytes)."""
    with deepspeed.zero.Init(config_dict_or_path=CONFIG):
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    before = _resident("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
    if not keep_partitions:
        partitioning.make_whole(model)  # the drop-in's former road: whole before the engine shards it
    engine, _, _, _ = deepspeed.initialize(model=model, config=CONFIG)
    peak = _resident("VmHWM") - before
    size = layers * (width * width + width) * 4
    del engine
    return peak, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    args = parser.parse_args()
    deepspeed.init_distributed()
    for keep in (True, False):
        peak, size = initialize_peak(args.layers, args.width, keep)
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, peak)
        if dist.get_rank() == 0:
            road = "partitions kept" if keep else "gathered whole first"
            print(f"{road}: initialize peak per rank {[f'{p / 2**20:.1f} MiB' for p in peaks]} "
                  f"(model {size / 2**20:.1f} MiB in fp32, {dist.get_world_size()} ranks)", flush=True)


if __name__ == "__main__":
    main()
