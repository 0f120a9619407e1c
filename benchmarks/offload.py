"""Offload benchmark: each mode's throughput (and, on CUDA, the largest trainable model)
against plain training through the engine, and the incumbents — DeepSpeed ZeRO-Offload,
DeepSpeed ZeRO-3 offload and FSDP2 with ``CPUOffloadPolicy`` — on the same model, batch and
optimizer, all measured in the same run and printed as ratios to ours.

    python benchmarks/offload.py                          # small reference GPT, whatever device
    python benchmarks/offload.py --size 6.7b --batch 4 --accumulation 8 --seq-len 1024
    python benchmarks/offload.py --search                 # CUDA: largest depth per mode (up to OOM)

Modes: plain, activation swapping, optimizer offload, layer streaming (micro-batch-major
and layer-major). On CUDA it also reports MFU against ``--peak-tflops`` and peak device
memory. FSDP2 runs everywhere (on CPU over a one-process gloo group); DeepSpeed when it is
installed and the device is CUDA (its offload optimizer is a JIT-compiled CPU op). Every
configuration comes from one settings dict in DeepSpeed keys, which is what DeepSpeed is
given too. On a CPU device the offload modes move nothing useful (host = device): the
ratios then measure bookkeeping overhead only.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

import hybridtrain as ht
from hybridtrain.models.gpt import GPT, GPTConfig, causal_lm_loss, gpt_config

OPTIMIZER = {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}}
OFFLOAD_OPTIMIZER = {"device": "cpu", "pin_memory": True}

MODES: dict[str, dict[str, Any]] = {
    "plain": {},
    "activation_swap": {"activation_checkpointing": {"enabled": True, "cpu_checkpointing": True}},
    "optimizer_offload": {"zero_optimization": {"stage": 2, "reduce_bucket_size": 20_000_000,
                                                "offload_optimizer": OFFLOAD_OPTIMIZER}},
    "layer_streaming": {"layer_streaming": {"enabled": True, "boundary_activations": "host"}},
    "layer_major": {"layer_streaming": {"enabled": True, "boundary_activations": "host", "layer_major": True}},
}

# Each incumbent, the zero_optimization it is given, and our mode doing the same job.
DEEPSPEED: dict[str, tuple[dict[str, Any], str]] = {
    "deepspeed_zero_offload": ({"stage": 2, "offload_optimizer": OFFLOAD_OPTIMIZER}, "optimizer_offload"),
    "deepspeed_zero3_offload": ({"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                 "offload_optimizer": OFFLOAD_OPTIMIZER}, "layer_major"),
}
FSDP2_PEER = "layer_major"


@dataclass
class Result:
    """One configuration's measured step."""

    step_s: float
    tokens_s: float
    tflops: float
    params: int
    peak_gib: float


@dataclass
class Setup:
    """The workload every configuration trains."""

    model: GPTConfig
    batch: int
    accumulation: int
    steps: int
    device: str

    def settings(self, **extra: Any) -> dict[str, Any]:
        """The shared settings in DeepSpeed keys (what DeepSpeed is given, plus ``extra``)."""
        return {"train_micro_batch_size_per_gpu": self.batch, "gradient_accumulation_steps": self.accumulation,
                "bf16": {"enabled": self.device == "cuda"}, "optimizer": copy.deepcopy(OPTIMIZER), **extra}

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One global batch (``batch × accumulation`` sequences)."""
        tokens = torch.randint(0, self.model.vocab_size, (self.batch * self.accumulation, self.model.seq_len + 1),
                               device=self.device)
        return tokens[:, :-1], tokens[:, 1:]

    def micro_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The global batch cut into the micro-batches a hand-written loop feeds."""
        inputs, targets = self.data()
        return list(zip(inputs.split(self.batch), targets.split(self.batch), strict=True))

    def new_model(self) -> GPT:
        torch.manual_seed(0)
        return GPT(self.model)


def _time(setup: Setup, model: nn.Module, step: Callable[[], object]) -> Result:
    """Median seconds per step (after one warm-up step; the median shrugs off a step that
    another process on the machine slowed down) and what follows from them."""
    step()
    _sync(setup.device)
    if setup.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(setup.steps):
        start = time.perf_counter()
        step()
        _sync(setup.device)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    params = sum(p.numel() for p in model.parameters())
    tokens = setup.batch * setup.accumulation * setup.model.seq_len
    peak = torch.cuda.max_memory_allocated() / 2**30 if setup.device == "cuda" else math.nan
    return Result(seconds, tokens / seconds, 6 * params * tokens / seconds / 1e12, params, peak)


def measure(setup: Setup, mode: dict[str, Any]) -> Result:
    """Our engine in ``mode``."""
    model = setup.new_model()
    engine = ht.initialize(model, {"device": setup.device, **setup.settings(**mode)}, loss_fn=causal_lm_loss)
    data = setup.data()
    return _time(setup, model, lambda: engine.train_batch(data))


def measure_fsdp2(setup: Setup) -> Result:
    """FSDP2 (``fully_shard`` per block and at the root) with ``CPUOffloadPolicy``: fp32
    parameters, gradients and AdamW state in host memory, the optimizer step on the host."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    _single_process_group(setup.device)
    mesh = init_device_mesh(setup.device, (1,))
    model = setup.new_model().to(setup.device)
    precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if setup.device == "cuda" else None)
    policy = CPUOffloadPolicy(pin_memory=setup.device == "cuda")
    for block in model.blocks:
        fully_shard(block, mesh=mesh, offload_policy=policy, mp_policy=precision)
    fully_shard(model, mesh=mesh, offload_policy=policy, mp_policy=precision)
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIMIZER["params"])  # type: ignore[arg-type]
    micro_batches = setup.micro_batches()

    def step() -> None:
        for index, micro in enumerate(micro_batches):
            model.set_requires_gradient_sync(index == len(micro_batches) - 1)  # type: ignore[operator]
            (causal_lm_loss(model(micro[0]), micro) / len(micro_batches)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _time(setup, model, step)


def measure_deepspeed(setup: Setup, zero: dict[str, Any]) -> Result:
    """DeepSpeed with ``zero_optimization = zero`` and otherwise the shared settings."""
    import deepspeed

    _single_process_group(setup.device)
    model = setup.new_model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=setup.settings(zero_optimization=copy.deepcopy(zero)))
    micro_batches = setup.micro_batches()

    def step() -> None:
        for micro in micro_batches:  # DeepSpeed scales by 1/accumulation and steps at the boundary
            engine.backward(causal_lm_loss(engine(micro[0]), micro))
            engine.step()

    return _time(setup, model, step)


def baselines(setup: Setup) -> dict[str, tuple[Result | str, str]]:
    """Each incumbent's result (or why it did not run) and the mode it is compared with."""
    out: dict[str, tuple[Result | str, str]] = {}
    try:
        out["fsdp2_cpu_offload"] = (measure_fsdp2(setup), FSDP2_PEER)
    except (RuntimeError, ValueError) as exc:
        out["fsdp2_cpu_offload"] = (f"failed: {exc}".splitlines()[0], FSDP2_PEER)
    for name, (zero, peer) in DEEPSPEED.items():
        if importlib.util.find_spec("deepspeed") is None:
            out[name] = ("not installed (pip install deepspeed)", peer)
        elif setup.device != "cuda":
            out[name] = ("needs CUDA (its offload optimizer is a compiled CPU op for GPU training)", peer)
        else:
            try:
                out[name] = (measure_deepspeed(setup, zero), peer)
            except (RuntimeError, ValueError, ImportError) as exc:
                out[name] = (f"failed: {exc}".splitlines()[0], peer)
    return out


def largest_depth(setup: Setup, mode: dict[str, Any], limit: int = 512) -> int:
    """Largest ``n_layer`` of the model's width that trains one step (doubling, then bisect)."""
    def fits(n: int) -> bool:
        try:
            measure(Setup(replace(setup.model, n_layer=n), setup.batch, setup.accumulation, 1, setup.device), mode)
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


def _single_process_group(device: str) -> None:
    """A one-process group for FSDP2 and DeepSpeed (they need one even for a single rank)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # DeepSpeed reads the rendezvous from the environment, as torchrun would set it.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo", rank=0, world_size=1)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _row(name: str, r: Result, peak_tflops: float, device: str, ratio: str) -> str:
    mfu = f"{r.tflops / peak_tflops:6.1%}" if device == "cuda" else f"{'-':>6s}"
    return (f"{name:24s} {r.step_s:8.3f} {r.tokens_s:10.0f} {r.tflops:8.3f} {mfu} {r.peak_gib:8.2f} {ratio}")


def main(argv: list[str] | None = None) -> None:
    """Print one line per mode (ratio to ``plain``) and per incumbent (our peer's ratio to it)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size", default="mini")
    parser.add_argument("--n-layer", type=int, default=None, help="override the size's depth")
    parser.add_argument("--seq-len", type=int, default=None, help="override the size's sequence length")
    parser.add_argument("--batch", type=int, default=4, help="micro-batch size")
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    parser.add_argument("--no-baselines", action="store_true", help="skip DeepSpeed and FSDP2")
    parser.add_argument("--search", action="store_true", help="CUDA: largest depth per mode")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="device bf16 peak (H100 SXM: 989)")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in (("n_layer", args.n_layer), ("seq_len", args.seq_len)) if v is not None}
    setup = Setup(gpt_config(args.size, **overrides), args.batch, args.accumulation, args.steps, args.device)
    modes = ["plain", *[m for m in args.modes if m != "plain"]]
    print(f"device={args.device} torch={torch.__version__} threads={torch.get_num_threads()} size=gpt-{args.size} "
          f"n_layer={setup.model.n_layer} seq_len={setup.model.seq_len} micro_batch={args.batch} "
          f"accumulation={args.accumulation}")
    # The process's first training run pays one-off costs (kernel and allocator warm-up,
    # thread pools) that would land on whichever configuration happens to be measured first.
    measure(replace(setup, steps=1), MODES["plain"])
    results = {name: measure(setup, MODES[name]) for name in modes}
    print(f"{'configuration':24s} {'step s':>8s} {'tokens/s':>10s} {'TFLOP/s':>8s} {'MFU':>6s} {'peak GiB':>8s} ratio")
    base = results["plain"]
    for name, r in results.items():
        print(_row(name, r, args.peak_tflops, args.device, f"{r.tokens_s / base.tokens_s:.2f}x plain"))
    if not args.no_baselines:
        for name, (outcome, peer) in baselines(setup).items():
            if isinstance(outcome, str):
                print(f"{name:24s} {outcome}")
            else:
                ratio = f"ours ({peer}) {results[peer].tokens_s / outcome.tokens_s:.2f}x it" if peer in results else ""
                print(_row(name, outcome, args.peak_tflops, args.device, ratio))
    if args.search and args.device == "cuda":
        depths = {name: largest_depth(setup, MODES[name]) for name in modes}
        for name, depth in depths.items():
            print(f"largest n_layer {name:20s} {depth:5d}  ({depth / max(depths['plain'], 1):.2f}x plain)")


if __name__ == "__main__":
    main()
