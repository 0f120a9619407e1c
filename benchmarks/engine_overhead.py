"""Engine overhead: tokens/s and memory of the reference GPT under each technique of the
engine, against a hand-written PyTorch loop doing the same math, measured in one run.

    python benchmarks/engine_overhead.py [--model gpt-mini] [--steps 20] [--rounds 5]

Runs alternate (hand, engine, hand, engine …) so drift in machine speed hits both; the
median per-step time over the rounds is reported. Memory is the peak allocated CUDA
memory on a GPU, and on CPU the bytes autograd saved for backward during one step (the
activation memory the techniques change). Goal: overhead ≤ 3 % for plain training.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import hybridtrain as ht
from hybridtrain.models.gpt import GPT, build_gpt, causal_lm_loss
from hybridtrain.profiling import SavedTensorMeter

Step = Callable[[tuple[torch.Tensor, torch.Tensor]], float]


def hand_step(model: GPT, opt: torch.optim.Optimizer, accum: int, ckpt: bool,
              dtype: torch.dtype | None, device: torch.device) -> Step:
    """The plain PyTorch loop a user would write for the technique."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device)
        h = model.drop(model.tok_emb(x) + model.pos_emb(pos))
        for block in model.blocks:
            h = checkpoint(block, h, use_reentrant=False) if ckpt else block(h)
        return model.head(model.ln_f(h))

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for xs, ys in zip(x.chunk(accum), y.chunk(accum), strict=True):
            with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                logits = forward(xs)
                loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), ys.reshape(-1)) / accum
            loss.backward()
            total += loss.detach()
        opt.step()
        return float(total)

    return step


TECHNIQUES: dict[str, dict[str, Any]] = {
    "plain": {},
    "accumulation x4": {"gradient_accumulation_steps": 4},
    "checkpointing": {"activation_checkpointing": {"enabled": True}},
    "bf16": {"bf16": {"enabled": True}},
    "bf16 + accum x4 + ckpt": {"bf16": {"enabled": True}, "gradient_accumulation_steps": 4,
                               "activation_checkpointing": {"enabled": True}},
}


def measure(step: Step, batch: tuple[torch.Tensor, torch.Tensor], steps: int, device: torch.device) -> float:
    """Seconds per step over ``steps`` steps."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def memory(step: Step, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> int:
    """Peak CUDA bytes of one step, or bytes saved for backward on CPU."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        step(batch)
        return int(torch.cuda.max_memory_allocated())
    with SavedTensorMeter() as meter:
        step(batch)
    return meter.bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", nargs="*", help="techniques to run (default: all)")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    base = build_gpt(args.model)
    seq = base.config.seq_len
    tokens = args.batch * seq
    x = torch.randint(0, base.config.vocab_size, (args.batch, seq + 1), device=device)
    batch = (x[:, :-1].contiguous(), x[:, 1:].contiguous())
    where = torch.cuda.get_device_name() if device.type == "cuda" else \
        f"{platform.processor() or 'cpu'}, {torch.get_num_threads()} threads"
    millions = sum(p.numel() for p in base.parameters()) / 1e6
    print(f"model {args.model} ({millions:.1f}M params), batch {args.batch}×{seq}, "
          f"device {where}, torch {torch.__version__}")
    mem_label = "peak MiB" if device.type == "cuda" else "saved-for-backward MiB"
    print(f"{'technique':<24} {'hand tok/s':>11} {'engine tok/s':>13} {'engine/hand':>12} {'overhead':>9}   "
          f"{mem_label} hand / engine")
    for name, config in TECHNIQUES.items():
        if args.only and name not in args.only:
            continue
        hand_model = copy.deepcopy(base).to(device)
        hand = hand_step(hand_model, torch.optim.AdamW(hand_model.parameters(), lr=1e-4),
                         config.get("gradient_accumulation_steps", 1), "activation_checkpointing" in config,
                         torch.bfloat16 if "bf16" in config else None, device)
        engine = ht.initialize(copy.deepcopy(base), {**config, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}},
                               loss_fn=causal_lm_loss)
        for step in (hand, engine.train_batch):  # warm-up: allocator, kernels, optimizer state
            for _ in range(2):
                step(batch)
        hand_t, engine_t = [], []
        for _ in range(args.rounds):
            hand_t.append(measure(hand, batch, args.steps, device))
            engine_t.append(measure(engine.train_batch, batch, args.steps, device))
        h, e = statistics.median(hand_t), statistics.median(engine_t)
        mem_h, mem_e = memory(hand, batch, device), memory(engine.train_batch, batch, device)
        print(f"{name:<24} {tokens / h:>11,.0f} {tokens / e:>13,.0f} {h / e:>12.3f} {100 * (e / h - 1):>8.1f}%   "
              f"{mem_h / 2**20:,.1f} / {mem_e / 2**20:,.1f}")


if __name__ == "__main__":
    main()
