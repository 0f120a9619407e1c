"""Host optimizer step in parameters/s: torch's fused CPU AdamW — what optimizer offload and
layer streaming run on the host — against DeepSpeed's compiled ``DeepSpeedCPUAdam`` when
DeepSpeed is installed (its op is built just in time), and against torch's ``foreach`` and
for-loop AdamW, all in the same run, printed as ratios — and against the physical limit:
the step is memory-bound (28 bytes per parameter, ``host_bandwidth.ADAM_BYTES_PER_PARAM``),
so each implementation's bytes/s is printed as a fraction of this host's memory bandwidth,
measured in the same run by a STREAM-style triad at the same thread count.

    python benchmarks/cpu_adam.py                       # 20M parameters in 8 tensors
    python benchmarks/cpu_adam.py --numel 200_000_000 --tensors 32 --threads 16

Every implementation starts from the same weights and gradients; the first step's result
is compared with the for-loop AdamW (the reference) so a fast-but-wrong kernel shows. One
that fails (DeepSpeed's op build needs ninja and a compiler) is printed with the reason; the
last line is ``RESULTS {json}``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import time
from collections.abc import Callable

import torch

from hybridtrain.profiling.host_bandwidth import ADAM_BYTES_PER_PARAM, triad_bandwidth

HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}

Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def implementations() -> dict[str, Factory]:
    """The optimizers compared, by name (DeepSpeed's only when it is installed)."""
    impls: dict[str, Factory] = {
        "torch_fused": lambda ps: torch.optim.AdamW(ps, fused=True, **HYPER),  # type: ignore[arg-type]
        "torch_foreach": lambda ps: torch.optim.AdamW(ps, foreach=True, **HYPER),  # type: ignore[arg-type]
        "torch_for_loop": lambda ps: torch.optim.AdamW(ps, foreach=False, **HYPER),  # type: ignore[arg-type]
    }
    if importlib.util.find_spec("deepspeed") is not None:
        def deepspeed_cpu_adam(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer: torch.optim.Optimizer = DeepSpeedCPUAdam(ps, adamw_mode=True, **HYPER)
            return optimizer
        impls["deepspeed_cpu_adam"] = deepspeed_cpu_adam
    return impls


def make_params(numel: int, tensors: int, seed: int = 0) -> list[torch.nn.Parameter]:
    """``tensors`` fp32 parameters of ``numel`` elements in all, with gradients set."""
    gen = torch.Generator().manual_seed(seed)
    size = numel // tensors
    params = []
    for _ in range(tensors):
        p = torch.nn.Parameter(torch.randn(size, generator=gen))
        p.grad = torch.randn(size, generator=gen)
        params.append(p)
    return params


def measure(factory: Factory, numel: int, tensors: int, steps: int) -> tuple[float, list[torch.Tensor]]:
    """Parameters updated per second over ``steps`` steps (after one warm-up step, which
    also creates the state), and the weights after the warm-up step."""
    params = make_params(numel, tensors)
    optimizer = factory(params)
    optimizer.step()
    first = [p.detach().clone() for p in params]
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    seconds = time.perf_counter() - start
    return sum(p.numel() for p in params) * steps / seconds, first


def main(argv: list[str] | None = None) -> None:
    """Print params/s per implementation and the fused kernel's ratio to each."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--numel", type=lambda s: int(s.replace("_", "")), default=20_000_000)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for every implementation and the triad (default: torch's)")
    parser.add_argument("--triad-numel", type=lambda s: int(s.replace("_", "")), default=64 * 2**20,
                        help="fp32 elements per triad array (default 64Mi: 256 MiB, beyond the caches)")
    parser.add_argument("--only", type=lambda s: s.split(","), default=None, metavar="NAME,NAME",
                        help=f"implementations to run (default: all of {', '.join(implementations())})")
    parser.add_argument("--jsonl", default=None, help="append the rows to this file as JSON lines")
    args = parser.parse_args(argv)
    chosen = {name: f for name, f in implementations().items() if args.only is None or name in args.only}
    if args.only is not None and len(chosen) != len(set(args.only)):
        parser.error(f"--only {','.join(args.only)}: choose from {', '.join(implementations())}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    bandwidth = triad_bandwidth(args.triad_numel)
    print(f"torch={torch.__version__} threads={torch.get_num_threads()} numel={args.numel:,} "
          f"tensors={args.tensors} steps={args.steps} host_memory_triad={bandwidth / 1e9:.1f} GB/s")
    results: dict[str, tuple[float, list[torch.Tensor]]] = {}
    failed: dict[str, str] = {}
    for name, factory in chosen.items():
        try:
            results[name] = measure(factory, args.numel, args.tensors, args.steps)
        except Exception as exc:  # e.g. DeepSpeed's JIT build: ImportError, OSError, CalledProcessError
            failed[name] = f"failed: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:160]}"
    reference = results.get("torch_for_loop", (math.nan, []))[1]
    fused = results.get("torch_fused", (math.nan, []))[0]
    print(f"{'implementation':20s} {'params/s':>14s} {'GB/s':>7s} {'of triad':>8s} "
          f"{'max |Δ| vs for-loop':>20s} torch_fused ratio")
    rows = []
    for name, (rate, weights) in results.items():
        # Without the for-loop reference in this run (--only), there is nothing to compare with.
        diff = max((float((w - r).abs().max()) for w, r in zip(weights, reference, strict=True)),
                   default=math.nan) if reference else math.nan
        bytes_s = rate * ADAM_BYTES_PER_PARAM
        print(f"{name:20s} {rate:14,.0f} {bytes_s / 1e9:7.1f} {bytes_s / bandwidth:8.2f} "
              f"{diff:20.2e} {fused / rate:8.2f}x")
        rows.append({"name": name, "status": "ok", "params_s": rate, "bytes_s": bytes_s,
                     "bandwidth_fraction": bytes_s / bandwidth, "max_abs_diff": diff})
    for name, why in failed.items():
        print(f"{name:20s} {why}")
        rows.append({"name": name, "status": why, "params_s": None, "bytes_s": None,
                     "bandwidth_fraction": None, "max_abs_diff": None})
    if "deepspeed_cpu_adam" not in implementations():
        print("DeepSpeedCPUAdam: DeepSpeed not installed; compared with torch only")
    summary = {"numel": args.numel, "tensors": args.tensors, "steps": args.steps, "torch": torch.__version__,
               "threads": torch.get_num_threads(), "host_memory_triad_bytes_s": bandwidth, "rows": rows}
    # Strict JSON: NaN (nothing to compare with) becomes null.
    print("RESULTS " + json.dumps(json.loads(json.dumps(summary), parse_constant=lambda _: None)), flush=True)
    if args.jsonl is not None:
        with open(args.jsonl, "a") as fh:
            for row in rows:
                gparams = row["params_s"] / 1e9 if row["params_s"] else None
                line = {"part": "host_optimizer", "numel": args.numel, "threads": torch.get_num_threads(),
                        "host_memory_triad_bytes_s": bandwidth, **row, "gparams_s": gparams}
                fh.write(json.dumps(json.loads(json.dumps(line), parse_constant=lambda _: None)) + "\n")


if __name__ == "__main__":
    main()
