"""Data-parallel scaling and ZeRO memory: DDP and ZeRO-1/2/3 over N CPU (or GPU) ranks.

    python benchmarks/data_parallel.py [--model gpt-mini] [--ranks 1 2] [--steps 6]

For each rank count the script starts itself under ``hybridtrain``'s launcher (torchrun);
every rank trains the same global batch (weak scaling is not the point: the global batch
is fixed, so ideal speed-up is N) under each mode and reports

- samples/s of the global batch and the speed-up against the 1-rank run of this script;
- the bytes of parameters, gradients and optimizer states this rank holds after a step
  (local shards under ZeRO), and their ratio to the replicated (DDP) model states —
  ZeRO-3 should hold ≈ 1/N of them.

On a machine with fewer cores than ranks the speed-up is capped by the cores; the bytes
do not depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

MODES: dict[str, dict[str, Any]] = {
    "ddp": {},
    "zero1": {"zero_optimization": {"stage": 1}},
    "zero2": {"zero_optimization": {"stage": 2}},
    "zero3": {"zero_optimization": {"stage": 3}},
}


def _local_bytes(tensors: list[torch.Tensor]) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def worker(model_name: str, steps: int, global_batch: int, seq_len: int, out_dir: str) -> None:
    """One rank: train each mode, time the steps after a warm-up one, count held bytes."""
    import hybridtrain as ht
    from hybridtrain.models.gpt import build_gpt, causal_lm_loss

    rank = int(os.environ.get("RANK", "0"))
    results: dict[str, Any] = {}
    for mode, extra in MODES.items():
        torch.manual_seed(0)
        model = build_gpt(model_name, seq_len=seq_len)
        engine = ht.initialize(model, {"device": "auto", "train_batch_size": global_batch, **extra},
                               loss_fn=causal_lm_loss)
        gen = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, model.config.vocab_size, (global_batch, seq_len + 1), generator=gen)
        batch = engine.local_batch((tokens[:, :-1], tokens[:, 1:]))
        engine.train_batch(batch)  # warm-up: allocations, FSDP lazy init
        engine.parallel.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            engine.train_batch(batch)
        engine.parallel.barrier()
        elapsed = time.perf_counter() - start
        params = list(engine.module.parameters())
        states = [v for s in engine.optimizer.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0]
        results[mode] = {"samples_per_s": global_batch * steps / elapsed,
                         "param_bytes": _local_bytes(params),
                         "grad_bytes": _local_bytes([p.grad for p in params if p.grad is not None]),
                         "optim_bytes": _local_bytes(states)}
    if rank == 0:
        Path(out_dir, "result.json").write_text(json.dumps(results))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--worker", metavar="OUT_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        worker(args.model, args.steps, args.global_batch, args.seq_len, args.worker)
        return 0

    from hybridtrain.parallel.launch import LaunchSpec, launch

    table: dict[int, dict[str, Any]] = {}
    for n in args.ranks:
        with tempfile.TemporaryDirectory() as out:
            worker_args = ["--model", args.model, "--steps", str(args.steps), "--global-batch",
                           str(args.global_batch), "--seq-len", str(args.seq_len), "--worker", out]
            code = launch(LaunchSpec(nproc_per_node=str(n)), __file__, worker_args)
            if code:
                return code
            table[n] = json.loads(Path(out, "result.json").read_text())
    base = table[min(table)]
    print(f"# {args.model}, global batch {args.global_batch}×{args.seq_len}, {args.steps} steps, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    print("| mode | ranks | samples/s | speed-up vs 1 rank | params MiB | grads MiB | optimizer MiB "
          "| model states vs DDP |")
    print("|---|---|---|---|---|---|---|---|")
    for n, modes in table.items():
        ddp_states = sum(modes["ddp"][k] for k in ("param_bytes", "grad_bytes", "optim_bytes"))
        for mode, r in modes.items():
            states = r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"]
            speedup = r["samples_per_s"] / base[mode]["samples_per_s"]
            print(f"| {mode} | {n} | {r['samples_per_s']:.1f} | {speedup:.2f}x "
                  f"| {r['param_bytes'] / 2**20:.2f} | {r['grad_bytes'] / 2**20:.2f} | {r['optim_bytes'] / 2**20:.2f} "
                  f"| {states / ddp_states:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
