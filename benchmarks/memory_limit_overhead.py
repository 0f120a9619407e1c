"""What the memory guard costs per training step of the reference GPT on CPU:

* ``recovery``: ``oom_recovery.enabled`` without a limit (before each step the RNG state,
  the loss scaler and the model's buffers are captured; an optimizer hook is registered);
* ``limit``: ``device_memory_limit`` as well, so every aten op's outputs are counted by
  :class:`~hybridtrain.runtime.memory_limit.LiveTensorBytes` (a Python dispatch mode);

each against ``engine.train_batch`` alone, plus what entering the count costs (one scan of
``gc.get_objects()``, once per training run and after each plan switch).

    python benchmarks/memory_limit_overhead.py [--size mini] [--batch 4] [--steps 8] [--rounds 4] [--threads 1]

Rounds alternate (off, recovery, limit, off, ...) so drift in machine speed hits all; the
figure is the median over rounds of the per-round ratio of median CPU time per step.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import torch

from hybridtrain.config import Config
from hybridtrain.models.gpt import GPT, causal_lm_loss, gpt_config
from hybridtrain.recovery.oom import initialize_guarded
from hybridtrain.runtime.memory_limit import LiveTensorBytes
from hybridtrain.units import format_bytes


def _median_step(train: Any, batch: Any, steps: int) -> float:
    """Median CPU seconds of this process per step: on a machine shared with other work,
    CPU time moves far less than wall time."""
    times = []
    for _ in range(steps):
        start = time.process_time()
        train(batch)
        times.append(time.process_time() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--size", default="mini")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: spinning workers "
                        "on a shared machine do not inflate the CPU time)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = gpt_config(args.size)

    def make(config: Config) -> torch.nn.Module:
        torch.manual_seed(0)
        return GPT(shape)

    base = {"device": "cpu", "train_batch_size": args.batch, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    guards = {
        "recovery": initialize_guarded(make, {**base, "oom_recovery": {"enabled": True}}, causal_lm_loss),
        "limit": initialize_guarded(make, {**base, "oom_recovery": {"enabled": True}, "device_memory_limit": "64GiB"},
                                    causal_lm_loss),
    }
    plain = guards["recovery"].engine  # the same engine, stepped without the guard
    tokens = torch.randint(0, shape.vocab_size, (args.batch, shape.seq_len + 1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    ratios: dict[str, list[float]] = {name: [] for name in guards}
    peak, off = 0, 0.0
    for _ in range(args.rounds):
        off = _median_step(plain.train_batch, batch, args.steps)
        for name, guard in guards.items():
            with guard:
                ratios[name].append(_median_step(guard.train_batch, batch, args.steps) / off)
                if guard.live is not None:
                    peak = guard.live.peak_bytes
    enters = []
    for _ in range(5):
        start = time.perf_counter()
        with LiveTensorBytes():
            enters.append(time.perf_counter() - start)
    print(f"GPT {args.size}, batch {args.batch}, CPU: {off * 1e3:.1f} CPU ms per step without a guard; "
          f"{args.rounds} rounds of {args.steps} steps")
    for name, values in ratios.items():
        print(f"  {name:9s} guarded/plain = {statistics.median(values):.3f} "
              f"(min {min(values):.3f}, max {max(values):.3f}; {(statistics.median(values) - 1) * off * 1e3:+.1f} ms)")
    params = sum(p.numel() * p.element_size() for p in plain.module.parameters())
    print(f"entering the count: {statistics.median(enters) * 1e3:.1f} ms for {len(gc.get_objects())} Python objects")
    print(f"counted peak of a step {format_bytes(peak)} (weights {format_bytes(params)}, x4 with gradients and "
          f"AdamW's two moments = {format_bytes(4 * params)})")


if __name__ == "__main__":
    main()
