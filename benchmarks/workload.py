"""The workload every configuration of the offload benchmark trains, and how a step is timed.

Shared by our engine's modes (``offload.py``) and the peers (``peers.py``): the same model,
global batch, optimizer settings and clipping, in DeepSpeed keys, and one timing rule.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from hybridtrain.models.gpt import GPT, GPTConfig, gpt_param_count

GIB = 2**30
OPTIMIZER = {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}}
OFFLOAD_OPTIMIZER = {"device": "cpu", "pin_memory": True}


@dataclass
class Result:
    """One configuration's outcome: measurements when ``status`` is ``ok``, else why not."""

    name: str
    status: str = "ok"
    step_s: float = math.nan
    tokens_s: float = math.nan
    tflops: float = math.nan
    mfu: float = math.nan
    peak_gib: float = math.nan
    reserved_gib: float = math.nan
    """Peak memory the CUDA caching allocator reserved: what the device's capacity limits."""
    host_gib: float = math.nan
    params: int = 0
    transfer_bytes: dict[str, int] | None = None
    """Host⇄device bytes of the last timed step by kind (our engine only)."""
    planned_peak_gib: float = math.nan
    """The planner's device peak for this configuration (our engine only), to hold against ``peak_gib``."""
    planned_step_s: float = math.nan
    """The planner's step time, to hold against ``step_s``."""
    steps_timed: int = 0
    """Steps inside the timed window (after the warm-up steps)."""
    step_s_median: float = math.nan
    """Median of the timed steps' own intervals (each from the previous step's return)."""
    step_s_min: float = math.nan
    """The fastest timed step's interval."""
    config: dict[str, Any] | None = None
    """The exact settings this configuration ran with (peers: everything an auditor needs)."""
    timeline: dict[str, Any] | None = None
    """Seconds per part of one further step (:func:`hybridtrain.profiling.timeline.measure_timeline`)."""
    reason: str = ""
    """Why a ``skipped`` configuration did not run."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class Setup:
    """The workload every configuration trains."""

    model: GPTConfig
    batch: int
    accumulation: int
    steps: int
    device: str
    peak_tflops: float = 989.0
    clip: float = 0.0
    """Gradient clipping (every engine and baseline clips: the same math); 0 = none."""
    overlap: bool = True
    """Our engine's ``overlap_updates`` (as ``hybridtrain train`` sets it)."""
    warmup: int = 1
    """Untimed steps before the timed window."""
    peer_checkpointing: bool = False
    """The peers (DeepSpeed, FSDP2) checkpoint every block: their faster setting where their
    activations would not fit the device otherwise (6.7B at 16k tokens per micro-batch)."""

    def flops_per_token(self) -> int:
        """Model FLOPs per trained token: 6·N (the matmuls forward and backward; the tied
        embedding counted once, as the head) + 12·n_layer·seq_len·d_model (attention scores
        and values): PaLM's MFU definition. Recomputation is not counted."""
        cfg = self.model
        return 6 * gpt_param_count(cfg) + 12 * cfg.n_layer * cfg.seq_len * cfg.d_model

    def depth(self, n_layer: int, steps: int | None = None) -> Setup:
        return replace(self, model=replace(self.model, n_layer=n_layer), steps=self.steps if steps is None else steps)

    def settings(self, **extra: Any) -> dict[str, Any]:
        """The shared settings in DeepSpeed keys (its batch check: total = micro × accumulation × 1)."""
        return {"train_batch_size": self.batch * self.accumulation, "train_micro_batch_size_per_gpu": self.batch,
                "gradient_accumulation_steps": self.accumulation, "bf16": {"enabled": self.device == "cuda"},
                "optimizer": copy.deepcopy(OPTIMIZER), **({"gradient_clipping": self.clip} if self.clip else {}),
                **extra}

    def example(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One global batch's shapes, allocating nothing."""
        shape = (self.batch * self.accumulation, self.model.seq_len)
        return torch.empty(shape, dtype=torch.long, device="meta"), torch.empty(shape, dtype=torch.long, device="meta")

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One global batch (``batch × accumulation`` sequences)."""
        torch.manual_seed(0)
        tokens = torch.randint(0, self.model.vocab_size, (self.batch * self.accumulation, self.model.seq_len + 1),
                               device=self.device)
        return tokens[:, :-1], tokens[:, 1:]

    def micro_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The global batch cut into the micro-batches a hand-written loop feeds."""
        inputs, targets = self.data()
        return list(zip(inputs.split(self.batch), targets.split(self.batch), strict=True))


def build_model(cfg: GPTConfig) -> GPT:
    """The reference GPT in host memory, built on the meta device and filled cheaply: torch's
    random init takes minutes for billions of parameters, a tiled random pattern (std 0.02,
    GPT-2's depth-scaled residual projections) is a memory copy. Values change neither a
    step's speed nor its memory; they only have to keep the loss finite."""
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device="cpu")  # GPT re-ties its head to the embedding
    pattern = torch.randn(1_000_003, generator=torch.Generator().manual_seed(0)) * 0.02
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2:  # LayerNorm gains (the only 1-D weights) 1, biases 0
                p.fill_(1.0 if name.endswith("weight") else 0.0)
                continue
            flat, size = p.view(-1), pattern.numel()
            rows, rest = divmod(flat.numel(), size)
            flat[:rows * size].view(rows, size).copy_(pattern.expand(rows, size))
            flat[rows * size:].copy_(pattern[:rest])
            if name.endswith("proj.weight"):
                p.mul_(1 / math.sqrt(2 * cfg.n_layer))
    return model


def single_process_group(device: str) -> None:
    """The one-process group FSDP2 and DeepSpeed need even for one rank, made once per process and
    reused: CPU collectives over gloo, CUDA ones over NCCL."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # DeepSpeed reads the rendezvous from the environment, as torchrun would set it.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo", rank=0, world_size=1)


def time_steps(setup: Setup, name: str, step: Callable[[], object], settle: Callable[[], None] | None = None,
               **extra: Any) -> Result:
    """Time ``setup.steps`` steps after ``setup.warmup`` untimed ones.

    The clock starts after everything earlier has finished (``settle``: background host updates
    an overlapped step left running, then the device) and stops after the last timed step's
    background update and the device finished, so no warm-up work lands inside the window and
    no timed work outside it. ``step_s`` is the window over the steps (what a long run gets per
    step: each step's background update overlaps the next step, the last one's is waited for);
    ``step_s_median`` / ``step_s_min`` are the steps' own intervals, each from the previous
    step's return (the median shrugs off a step another process slowed down).
    """
    def finished() -> None:
        if settle is not None:
            settle()
        if setup.device == "cuda":
            torch.cuda.synchronize()

    for _ in range(setup.warmup):
        step()
    finished()
    marks = [time.perf_counter()]
    for index in range(setup.steps):
        step()
        if index == setup.steps - 1:
            finished()
        elif setup.device == "cuda":
            torch.cuda.synchronize()
        marks.append(time.perf_counter())
    intervals = [b - a for a, b in itertools.pairwise(marks)]
    seconds = (marks[-1] - marks[0]) / setup.steps if setup.steps else math.nan
    tokens_s = setup.batch * setup.accumulation * setup.model.seq_len / seconds
    tflops = setup.flops_per_token() * tokens_s / 1e12
    mfu = tflops / setup.peak_tflops if setup.device == "cuda" else math.nan
    return Result(name, "ok", seconds, tokens_s, tflops, mfu, params=gpt_param_count(setup.model),
                  steps_timed=setup.steps, step_s_median=statistics.median(intervals) if intervals else math.nan,
                  step_s_min=min(intervals, default=math.nan), **extra)


def bind_host_threads() -> dict[str, Any]:
    """Bind this process to the first ``physical cores`` CPUs and use one thread per core, as
    DeepSpeed's ``--bind_cores_to_rank`` does for one rank (``deepspeed/utils/numa.py``
    ``get_numactl_cmd``: cores ``0..physical-1``, ``OMP_NUM_THREADS`` = their count; DeepSpeed
    reports ~1.3x on its CPU Adam from it). Every configuration of the run gets the same
    binding. ``OMP_NUM_THREADS`` is set before DeepSpeed's op loads its OpenMP runtime.

    Returns:
        What was bound (a row's ``config`` records it).
    """
    try:
        import psutil

        physical = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except ImportError:  # the GPU image may lack psutil: then every logical CPU
        physical = os.cpu_count() or 1
    cores = sorted(os.sched_getaffinity(0))[:physical] if hasattr(os, "sched_getaffinity") else []
    if cores:
        os.sched_setaffinity(0, cores)
    threads = len(cores) or physical
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    return {"cores": f"{cores[0]}-{cores[-1]}" if cores else "all", "threads": threads}
