"""What the read guard of overlapped host updates costs: the reference GPT's forward and
backward with :class:`~hybridtrain.runtime.offload.wait_before_reads.WaitBeforeReads` entered and
a weight still pending (so every op's arguments are looked at), against the same step
without it, measured in one run.

    python benchmarks/wait_before_reads.py [--model gpt-mini] [--steps 20] [--rounds 5]

Runs alternate (bare, guarded, bare, guarded …) so drift in machine speed hits both; the
median per-step time over the rounds is reported, with the guard's cost per torch call.
On a GPU the calls queue kernels while earlier ones run, so this CPU figure is the worst
case: the time a small model's step spends in Python per op.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time

import torch
from torch.overrides import TorchFunctionMode

from hybridtrain.models.gpt import build_gpt, causal_lm_loss
from hybridtrain.runtime.offload.wait_before_reads import WaitBeforeReads


class _CountCalls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the comparison; returns the ratios (guarded and settled over bare)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = build_gpt(args.model)
    seq = model.config.seq_len
    tokens = torch.randint(0, model.config.vocab_size, (args.batch, seq + 1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    # A pending entry that no op reads: every call pays the argument scan, none waits.
    pending: dict[int, object] = {id(object()): lambda: None}

    def step() -> None:
        loss = causal_lm_loss(model(batch[0]), batch)
        loss.backward()
        model.zero_grad(set_to_none=True)

    def timed(watching: dict[int, object] | None) -> float:
        start = time.perf_counter()
        for _ in range(args.steps):
            with WaitBeforeReads(watching) if watching is not None else contextlib.nullcontext():  # type: ignore[arg-type]
                step()
        return (time.perf_counter() - start) / args.steps

    counter = _CountCalls()
    with counter:
        step()
    step()  # warm-up
    bare, guarded, settled = [], [], []
    for _ in range(args.rounds):
        bare.append(timed(None))
        guarded.append(timed(pending))
        settled.append(timed({}))  # entered, every update already waited for
    b, g, e = statistics.median(bare), statistics.median(guarded), statistics.median(settled)
    print(f"{platform.processor() or platform.machine()} threads={torch.get_num_threads()} torch={torch.__version__} "
          f"model={args.model} batch={args.batch}x{seq}")
    print(f"step bare {b * 1e3:.2f} ms, guarded {g * 1e3:.2f} ms: guarded/bare {g / b:.3f}; "
          f"{counter.calls} torch calls in forward+loss, {(g - b) / counter.calls * 1e6:.2f} us per call")
    print(f"guard entered with nothing pending (the rest of a step once its weights are updated): "
          f"{e * 1e3:.2f} ms, {e / b:.3f}")
    return {"guarded": g / b, "settled": e / b, "calls": counter.calls}


if __name__ == "__main__":
    main()
