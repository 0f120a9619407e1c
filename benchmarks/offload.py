"""Offload benchmark: each mode's throughput (and, on CUDA, largest trainable model) as a
ratio to plain PyTorch-style training through the engine, measured in the same run.

    python benchmarks/offload.py                 # small reference GPT, whatever device
    python benchmarks/offload.py --search        # CUDA: largest depth per mode (up to OOM)

Modes: plain, activation swapping, optimizer offload, layer streaming. On CUDA it also
reports MFU against ``--peak-tflops``. (DeepSpeed / FSDP2 baselines are not wired in yet.)
On a CPU device the offload modes move nothing useful (host = device): the ratios then
measure the bookkeeping overhead only.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

import hybridtrain as ht
from hybridtrain.models.gpt import GPT, causal_lm_loss, gpt_config

MODES: dict[str, dict[str, Any]] = {
    "plain": {},
    "activation_swap": {"activation_checkpointing": {"enabled": True, "cpu_checkpointing": True}},
    "optimizer_offload": {"zero_optimization": {"stage": 2, "reduce_bucket_size": 20_000_000,
                                                "offload_optimizer": {"device": "cpu", "pin_memory": True}}},
    "layer_streaming": {"layer_streaming": {"enabled": True, "boundary_activations": "host"}},
}


def _batches(vocab: int, seq: int, batch: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (batch, seq + 1), device=device)
    return tokens[:, :-1], tokens[:, 1:]


def measure(size: str, overrides: dict[str, Any], mode: dict[str, Any], batch: int, steps: int,
            device: str) -> dict[str, float]:
    """Train ``steps`` steps (after one warm-up) and return tokens/s and step time."""
    cfg = gpt_config(size, **overrides)
    torch.manual_seed(0)
    config = {"device": device, "train_micro_batch_size_per_gpu": batch,
              "bf16": {"enabled": device == "cuda"}, **mode}
    engine = ht.initialize(GPT(cfg), config, loss_fn=causal_lm_loss)
    data = _batches(cfg.vocab_size, cfg.seq_len, batch, device)
    engine.train_batch(data)
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.train_batch(data)
    _sync(device)
    seconds = (time.perf_counter() - start) / steps
    params = sum(p.numel() for p in engine.module.parameters())
    tokens = batch * cfg.seq_len
    return {"step_s": seconds, "tokens_s": tokens / seconds, "tflops": 6 * params * tokens / seconds / 1e12,
            "params": float(params)}


def largest_depth(size: str, mode: dict[str, Any], batch: int, device: str, limit: int = 512) -> int:
    """Largest ``n_layer`` of the size's width that trains one step (doubling, then bisect)."""
    def fits(n: int) -> bool:
        try:
            measure(size, {"n_layer": n}, mode, batch, 1, device)
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            torch.cuda.empty_cache()
    low, high = 0, 1
    while high <= limit and fits(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> None:
    """Print one line per mode with its ratio to ``plain``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="mini")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--search", action="store_true", help="CUDA: largest depth per mode")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="device bf16 peak (H100 SXM: 989)")
    args = parser.parse_args(argv)
    print(f"device={args.device} torch={torch.__version__} size=gpt-{args.size} batch={args.batch}")
    results = {name: measure(args.size, {}, mode, args.batch, args.steps, args.device) for name, mode in MODES.items()}
    base = results["plain"]
    print(f"{'mode':20s} {'step s':>8s} {'tokens/s':>10s} {'TFLOP/s':>8s} {'MFU':>6s} {'vs plain':>9s}")
    for name, r in results.items():
        mfu = r["tflops"] / args.peak_tflops if args.device == "cuda" else float("nan")
        print(f"{name:20s} {r['step_s']:8.3f} {r['tokens_s']:10.0f} {r['tflops']:8.3f} {mfu:6.1%} "
              f"{r['tokens_s'] / base['tokens_s']:8.2f}x")
    if args.search and args.device == "cuda":
        depths = {name: largest_depth(args.size, mode, args.batch, args.device) for name, mode in MODES.items()}
        for name, depth in depths.items():
            print(f"largest n_layer {name:20s} {depth:5d}  ({depth / max(depths['plain'], 1):.2f}x plain)")


if __name__ == "__main__":
    main()
