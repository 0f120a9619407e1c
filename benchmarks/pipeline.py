"""Bubble fraction and activations in flight of torch's GPipe and 1F1B schedules, as
hybridtrain runs them (``torch.distributed.pipelining`` over gloo), against theory.

Each of K ranks runs one fixed-cost stage: forward sleeps ``F`` seconds, backward ``2F``
(a custom autograd function), so the timeline measures the schedule, not the 2-core CPU.
Every stage records when each forward/backward ran; per stage::

    bubble   = 1 - busy / makespan          (theory: (K-1) / (M+K-1) for both schedules)
    in flight = max over time of (forwards done - backwards done)   (GPipe: M, 1F1B: <= K)

Usage: ``python benchmarks/pipeline.py [--stages 4] [--micro 4 8 16] [--forward-ms 20]``.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class _Sleep(torch.autograd.Function):
    """Identity whose forward costs ``f`` seconds and backward ``2f``, logging both."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, f: float, log: list[tuple[str, float, float]]) -> torch.Tensor:
        ctx.f, ctx.log = f, log
        start = time.time()
        time.sleep(f)
        log.append(("F", start, time.time()))
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        start = time.time()
        time.sleep(2 * ctx.f)
        ctx.log.append(("B", start, time.time()))
        return grad * 1.0, None, None


class FixedCostStage(nn.Module):
    """A stage with one weight (so there is a backward) and a fixed forward cost."""

    def __init__(self, f: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))
        self.f = f
        self.log: list[tuple[str, float, float]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x * self.weight, self.f, self.log)  # type: ignore[no-any-return]


def _rank(rank: int, world: int, port: int, schedule: str, micro: int, f: float, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    module = FixedCostStage(f)
    example = torch.zeros(micro, 8, requires_grad=True)
    stage = PipelineStage(module, rank, world, torch.device("cpu"), input_args=(example[:1],),
                          output_args=example[:1])
    sched = SCHEDULES[schedule](stage, n_microbatches=micro, loss_fn=lambda y, _t: y.sum())
    for _ in range(2):  # the first step warms up the communication; the second is measured
        module.log.clear()
        dist.barrier()
        if rank == 0:
            sched.step(torch.ones(micro, 8))
        elif rank == world - 1:
            sched.step(target=torch.zeros(micro, 8))
        else:
            sched.step()
    logs: list[Any] = [None] * world
    dist.all_gather_object(logs, module.log)
    if rank == 0:
        out.put(logs)
    dist.destroy_process_group()


def measure(schedule: str, stages: int, micro: int, f: float) -> dict[str, float]:
    """Run one measured step; returns mean bubble, its theory, and peak in-flight count."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, stages, port, schedule, micro, f, queue)) for r in range(stages)]
    for proc in procs:
        proc.start()
    logs = queue.get(timeout=300)
    for proc in procs:
        proc.join(60)
    begin = min(s for log in logs for _, s, _ in log)
    end = max(e for log in logs for _, _, e in log)
    bubbles, peaks = [], []
    for log in logs:
        busy = sum(e - s for _, s, e in log)
        bubbles.append(1 - busy / (end - begin))
        live = peak = 0
        for kind, _, _ in sorted(log, key=lambda item: item[1]):
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        peaks.append(peak)
    return {"bubble": sum(bubbles) / len(bubbles), "theory": (stages - 1) / (micro + stages - 1),
            "peak_in_flight": float(max(peaks)), "peak_stage0": float(peaks[0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micro", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--forward-ms", type=float, default=20.0)
    args = parser.parse_args()
    print(f"K={args.stages} stages, forward {args.forward_ms:.0f} ms, backward {2 * args.forward_ms:.0f} ms")
    print(f"{'schedule':>8} {'M':>3} {'bubble':>7} {'theory':>7} {'ratio':>6} {'in flight':>9}")
    for micro in args.micro:
        for schedule in SCHEDULES:
            r = measure(schedule, args.stages, micro, args.forward_ms / 1000)
            print(f"{schedule:>8} {micro:>3} {r['bubble']:7.3f} {r['theory']:7.3f} "
                  f"{r['bubble'] / r['theory']:6.2f} {int(r['peak_in_flight']):>9}", flush=True)


if __name__ == "__main__":
    main()
