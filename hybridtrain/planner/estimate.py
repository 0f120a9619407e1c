"""``estimate(config, target)``: device and host bytes and seconds of one training step,
computed on the meta device (nothing allocated, no GPU needed).

The model the config names is built on the meta device (as ``hybridtrain config --plan``
does), resolved into a :class:`~hybridtrain.plan.types.TrainingPlan`, traced at the real
micro-batch shape (:mod:`hybridtrain.planner.trace`), and the plan's step replayed over
the trace for bytes (:mod:`~hybridtrain.planner.memory`) and seconds
(:mod:`~hybridtrain.planner.timing`). Traces are cached per model and micro-batch shape,
so the planner's many variants of one config cost one trace each.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Literal

import torch
from torch import nn

from hybridtrain.compat import tree_leaves, tree_map
from hybridtrain.config import Config, ConfigError, ConfigSource, load_config
from hybridtrain.data import TokenBatches, load_tokens
from hybridtrain.hardware.efficiency import kernel_efficiency
from hybridtrain.hardware.links import cpu_links, links_for
from hybridtrain.hardware.peaks import (
    device_memory_bytes,
    device_peak_flops,
    find_device,
    known_devices,
    measured_matmul_flops,
)
from hybridtrain.models.factory import build_model
from hybridtrain.models.gpt import causal_lm_loss
from hybridtrain.plan.resolve import resolve
from hybridtrain.plan.types import TrainingPlan
from hybridtrain.planner.memory import MemoryEstimate, estimate_memory, passes_for
from hybridtrain.planner.timing import Hardware, StepTime, estimate_time
from hybridtrain.planner.trace import PASSES, ModelTrace, trace_model
from hybridtrain.profiling.host_bandwidth import ADAM_BYTES_PER_PARAM, probe_host_bandwidth
from hybridtrain.profiling.link_bandwidth import probe_link_bandwidth
from hybridtrain.runtime.batch import Batch, LossFn
from hybridtrain.runtime.precision import half_width_params
from hybridtrain.units import format_bytes

GPU_KERNEL_SECONDS = 8e-6
"""Launch and dispatch cost per kernel of an eager PyTorch step on a GPU."""


@dataclass(frozen=True)
class Target:
    """The machine an estimate is for.

    Attributes:
        kind: ``cpu`` or ``cuda``.
        name: ``cpu`` or the GPU model's canonical name (``H100 SXM`` …).
        memory_bytes: device memory available to training (None: not limited).
        host_memory_bytes: host memory available (None: not limited).
        host_bandwidth: host memory bytes/s the host optimizer step streams at (None: this
            machine's, measured, when the target is this machine; else the GPU model's
            figure in :mod:`hybridtrain.hardware.links`).
        local: the target is this machine (its GPU found by torch, or its CPU).
        link_bandwidth: host⇄device bytes/s per direction (None: this machine's, measured by
            pinned copies, when the target is this machine's GPU; else the GPU model's
            figure in :mod:`hybridtrain.hardware.links`).
    """

    kind: Literal["cpu", "cuda"]
    name: str
    memory_bytes: int | None = None
    host_memory_bytes: int | None = None
    host_bandwidth: float | None = None
    local: bool = False
    link_bandwidth: float | None = None


def resolve_target(device: str | None = None, device_memory: int | None = None,
                   host_memory: int | None = None, host_bandwidth: float | None = None,
                   link_bandwidth: float | None = None) -> Target:
    """The target from ``--device NAME`` / ``--device-memory`` / ``--host-memory`` /
    ``--host-bandwidth``.

    Without a name: this machine's GPU when it has one, else the CPU (then the host
    bandwidth is this machine's, probed once). A GPU name gives its memory unless
    ``device_memory`` says otherwise, and a machine elsewhere: its host bandwidth is
    ``host_bandwidth`` or the model's figure in :mod:`hybridtrain.hardware.links`; its link
    ``link_bandwidth`` likewise (``--link-bandwidth``).

    Raises:
        ValueError: an unknown device name, naming the known ones.
    """
    local = device is None
    if device is None:
        if torch.cuda.is_available():
            device = torch.cuda.get_device_name()
        else:
            return Target("cpu", "cpu", device_memory, host_memory, host_bandwidth, local=True)
    if device.lower() == "cpu":
        return Target("cpu", "cpu", device_memory, host_memory, host_bandwidth, local=True)
    spec = find_device(device)
    if spec is None:
        raise ValueError(f"--device {device!r} is unknown; known: cpu, {', '.join(known_devices())} "
                         "(or give --device-memory BYTES for another device)")
    memory = device_memory if device_memory is not None else device_memory_bytes(spec.name)
    # A named GPU is this machine when it is the one torch sees here.
    local = local or (torch.cuda.is_available() and find_device(torch.cuda.get_device_name()) == spec)
    return Target("cuda", spec.name, memory, host_memory, host_bandwidth, local, link_bandwidth)


@dataclass(frozen=True)
class Estimate:
    """What one training step of a config needs, and how long it takes.

    Attributes:
        config: the configuration estimated.
        plan: its resolved plan.
        target: the machine.
        memory: bytes by place and kind.
        time: seconds by part.
        tokens_per_step: tokens of one optimizer step over all data-parallel ranks.
    """

    config: Config
    plan: TrainingPlan
    target: Target
    memory: MemoryEstimate
    time: StepTime
    tokens_per_step: int

    @property
    def device_peak_bytes(self) -> int:
        """Peak device bytes of one step (on a CPU: the peak of live tensor bytes)."""
        return self.memory.device_peak

    @property
    def host_bytes(self) -> int:
        """Host bytes the techniques hold."""
        return self.memory.host_bytes

    @property
    def step_seconds(self) -> float:
        """Predicted seconds of one optimizer step."""
        return self.time.total

    def problems(self, margin: float = 0.0) -> list[str]:
        """Why this does not fit the target (empty when it does), with the numbers.

        Args:
            margin: share of the device memory kept free (fragmentation, allocator caches).
        """
        out = []
        limit = self.target.memory_bytes
        if limit is not None and self.device_peak_bytes > limit * (1 - margin):
            out.append(f"device memory: needs {format_bytes(self.device_peak_bytes)}"
                       f"{f' + {margin:.0%} margin' if margin else ''}, has {format_bytes(limit)}")
        host = self.target.host_memory_bytes
        if host is not None and self.host_bytes > host:
            out.append(f"host memory: needs {format_bytes(self.host_bytes)} for offloaded state, "
                       f"has {format_bytes(host)}")
        return out

    def as_dict(self) -> dict[str, Any]:
        """The JSON of ``hybridtrain estimate --json``."""
        summary = self.plan.summary()
        return {
            "device_peak_bytes": self.device_peak_bytes,
            "host_bytes": self.host_bytes,
            "step_seconds": self.step_seconds,
            "tokens_per_second": self.tokens_per_step / self.step_seconds if self.step_seconds else None,
            "peak_at": self.memory.peak_at,
            "device": self.memory.device.as_dict(),
            "host": self.memory.host.as_dict(),
            "time": self.time.as_dict(),
            "target": {"kind": self.target.kind, "name": self.target.name,
                       "memory_bytes": self.target.memory_bytes,
                       "host_memory_bytes": self.target.host_memory_bytes,
                       "host_bandwidth": host_bandwidth(self.target) if self.target.kind == "cuda" else
                       self.target.host_bandwidth,
                       "link_bandwidth": link_bandwidth(self.target) if self.target.kind == "cuda" else None},
            "plan": {k: summary[k] for k in ("world", "batch", "precision", "checkpointed", "swapped",
                                               "streamed", "step_runner", "replication", "zero_stage",
                                               "optimizer")},
        }


def estimate(config: ConfigSource, target: Target | None = None, world_size: int = 1,
             all_passes: bool = False, model: ModelSource | None = None, half_width: bool = True,
             pipelined_host_step: bool = True) -> Estimate:
    """Estimate one training step of ``config`` on ``target`` (see the module docstring).

    Args:
        config: a ``Config``, a dict, or a JSON/YAML path; the model is ``config.model``.
        target: the machine (default: this one, unlimited).
        world_size: processes (data × tensor × pipeline parallel); the figures are per rank.
        all_passes: trace every block treatment at once (the planner estimates many
            variants of one micro-batch shape: one trace serves them all).
        model: a caller's model to estimate instead of the one ``config.model`` names
            (:func:`model_source`).
        half_width: model half-width transfers as build applies them; False plans every
            transfer at full width (the code before them: holding older measurements).
        pipelined_host_step: a deferred host step (clipping, fp16, skipped non-finite
            losses) hides behind the next forward; False plans it exposed after the
            backward (the code before the pipelined step: with ``half_width=False``,
            what the older H100 measurements were predicted with).

    Raises:
        ConfigError / ValueError: what ``hybridtrain train`` would refuse, in one line.
    """
    cfg = load_config(config)
    target = target or resolve_target()
    source = model or _config_source(cfg)
    # A GPU target is planned on the CPU when this machine has none: the decisions do not
    # depend on the device.
    on_cpu = target.kind == "cpu" or not torch.cuda.is_available()
    planned = cfg.model_copy(update={"device": "cpu" if on_cpu else "cuda" if cfg.device == "auto" else cfg.device})
    micro = cfg.train_micro_batch_size_per_gpu or 1
    example = source.example(micro) if source.real_example is None else source.real_example
    plan = resolve(planned, source.model, world_size, example_batch=example)
    trace = _trace(cfg, source, plan, target.kind, PASSES[1:] if all_passes else passes_for(plan))
    half_numel = half_width_numel(source.model, plan, [p.name for p in trace.blocks]) if half_width else None
    memory = estimate_memory(plan, trace, target.kind, half_numel)
    seconds = estimate_time(plan, trace, hardware(target, plan.compute_dtype), trace.kernels, half_numel,
                            pipelined_host_step)
    tokens = plan.batch.global_batch * source.tokens_per_sample
    return Estimate(cfg, plan, target, memory, seconds, tokens)


def half_width_numel(model: nn.Module, plan: TrainingPlan, blocks: list[str]) -> dict[str, int]:
    """Elements that cross host⇄device in half precision (:mod:`hybridtrain.runtime.precision.half_width`),
    per block module path and, under ``""``, in the whole model; empty where build moves
    everything at full width (fp32 runs, several processes)."""
    half_width_ids = half_width_params(model, plan.compute_dtype, plan.sizes.world)
    if not half_width_ids:
        return {}
    out = {name: sum(p.numel() for p in model.get_submodule(name).parameters() if id(p) in half_width_ids)
           for name in blocks}
    out[""] = sum(p.numel() for p in model.parameters() if id(p) in half_width_ids)
    return out


@dataclass(frozen=True)
class ModelSource:
    """The model a trace runs, on the meta device: built from the config, or a meta copy
    of a caller's model (:func:`model_source`).

    Attributes:
        model: the module, on the meta device.
        sample: one sample of a batch, on the meta device.
        real_example: the caller's example batch, for resolve (None: built from the config).
        loss_fn: the loss as the engine computes it.
        key: what identifies it in the trace cache.
    """

    model: nn.Module
    sample: Batch
    real_example: Batch | None
    loss_fn: LossFn | None
    key: tuple[Any, ...]

    def example(self, micro: int) -> Batch:
        """A meta batch of ``micro`` samples."""
        return tree_map(lambda t: t.expand(micro, *t.shape[1:]).contiguous()
                        if isinstance(t, torch.Tensor) and t.dim() else t, self.sample)

    @property
    def tokens_per_sample(self) -> int:
        """Elements of one sample's first tensor (tokens, for a language model)."""
        first = next((t for t in tree_leaves(self.sample) if isinstance(t, torch.Tensor)), None)
        return int(first[0].numel()) if first is not None and first.dim() else 1


def model_source(model: nn.Module, example_batch: Batch, loss_fn: LossFn | None = None) -> ModelSource:
    """A caller's model and one of its batches, to estimate without touching either: the
    module structure is copied with every parameter and buffer replaced by a meta tensor
    of its shape (tied parameters stay tied), so nothing of its size is allocated."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    meta = copy.deepcopy(model, memo)
    sample = tree_map(lambda t: t[:1].to("meta") if isinstance(t, torch.Tensor) and t.dim() else t, example_batch)
    return ModelSource(meta, sample, example_batch, loss_fn, ("model", id(meta)))


def meta_model(cfg: Config) -> nn.Module:
    """The model ``config.model`` names, built on the meta device (cached)."""
    return _config_source(cfg).model


def _config_source(cfg: Config) -> ModelSource:
    key = (cfg.model.name, json.dumps(cfg.model.overrides, sort_keys=True), cfg.data.seq_len, cfg.data.path,
           cfg.data.val_fraction)
    model, sample = _meta_model(*key)
    return ModelSource(model, (sample, torch.empty_like(sample)), None, causal_lm_loss, key)


@lru_cache(maxsize=8)
def _meta_model(name: str, overrides_json: str, seq_len: int, data_path: str | None,
                val_fraction: float) -> tuple[nn.Module, torch.Tensor]:
    """The model ``hybridtrain train`` would build, on the meta device, and one sample of
    token ids (the vocabulary is sized from the data as the trainer sizes it)."""
    overrides = json.loads(overrides_json)
    data = TokenBatches(load_tokens(data_path), seq_len, val_fraction, 0)
    vocab = int(overrides.get("vocab_size", max(256, data.max_token + 1)))
    with torch.device("meta"):
        model = build_model(name, overrides, vocab, seq_len, 0)
    return model, data.train_batch(0, 1)[0].to("meta")


_TRACES: dict[tuple[Any, ...], ModelTrace] = {}


def _trace(cfg: Config, source: ModelSource, plan: TrainingPlan, kind: str, passes: tuple[str, ...]) -> ModelTrace:
    key = (*source.key, plan.batch.micro_batch, plan.compute_dtype, kind, cfg.activation_offload.min_bytes,
           tuple(b.name for b in plan.blocks))
    known = _TRACES.get(key)
    if known is None or not set(passes) <= set(known.treated):
        passes = tuple(sorted(set(passes) | set(known.treated if known else ())))
        names = [b.name for b in plan.blocks]
        blocks = [source.model.get_submodule(name) for name in names]
        try:
            _TRACES[key] = trace_model(source.model, blocks, names, source.example(plan.batch.micro_batch),
                                       source.loss_fn, plan.compute_dtype, kind, passes,
                                       cfg.activation_offload.min_bytes)
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            name = cfg.model.name if source.real_example is None else type(source.model).__name__
            raise ConfigError(f"model {name}: "
                              f"its forward cannot run on the meta device, so it cannot be estimated without "
                              f"allocating ({first})") from None
    return _TRACES[key]


def hardware(target: Target, dtype: torch.dtype | None) -> Hardware:
    """The time model's view of ``target`` computing in ``dtype`` (None = fp32). On a GPU
    the host optimizer step streams :data:`ADAM_BYTES_PER_PARAM` bytes per element at the
    target's host bandwidth (the table's figure when none was measured or given): fused
    CPU AdamW reaches the in-place triad's rate (1.00x on the H100 machine, 2026-11-26).
    The device's rate is its dense peak times its kernel efficiency
    (:func:`hybridtrain.hardware.efficiency.kernel_efficiency`)."""
    dtype = dtype or torch.float32
    if target.kind == "cpu":
        bandwidth = _host_copy_bandwidth()
        return Hardware("cpu", measured_matmul_flops(torch.device("cpu"), dtype), cpu_links(bandwidth),
                        _cpu_op_seconds(), (target.host_bandwidth or bandwidth) / ADAM_BYTES_PER_PARAM)
    peak = device_peak_flops(target.name, dtype) or device_peak_flops(target.name, torch.float16) or 1e14
    links = replace(links_for(target.name), host_memory=host_bandwidth(target),
                    host_to_device=link_bandwidth(target))
    return Hardware("cuda", peak * kernel_efficiency(target.name).share, links, GPU_KERNEL_SECONDS,
                    links.host_memory / ADAM_BYTES_PER_PARAM)


def host_bandwidth(target: Target) -> float:
    """Host memory bytes/s of ``target``: as given; this machine's, measured by a short
    in-place triad (the host Adam step's access pattern, cached per process), when the
    target is this machine's GPU; else the GPU model's published machine's figure
    (:func:`hybridtrain.hardware.links.links_for`)."""
    return host_bandwidth_source(target)[0]


def host_bandwidth_source(target: Target) -> tuple[float, str]:
    """:func:`host_bandwidth` and where it comes from: ``given``, ``measured here`` or
    ``the NAME table figure``."""
    if target.host_bandwidth is not None:
        return target.host_bandwidth, "given"
    if target.local:
        return probe_host_bandwidth(), "measured here"
    return links_for(target.name).host_memory, f"the {target.name} table figure; --host-bandwidth for another machine"


def link_bandwidth(target: Target) -> float:
    """Host⇄device bytes/s per direction of a GPU ``target``, taken as :func:`host_bandwidth`
    is: as given; this machine's, measured (the slower direction of pinned copies, cached
    per process), when the target is this machine's GPU; else the GPU model's figure."""
    return link_bandwidth_source(target)[0]


def link_bandwidth_source(target: Target) -> tuple[float, str]:
    """:func:`link_bandwidth` and where it comes from: ``given``, ``measured here`` or
    ``the NAME table figure``."""
    if target.link_bandwidth is not None:
        return target.link_bandwidth, "given"
    if target.local and torch.cuda.is_available():
        return probe_link_bandwidth(), "measured here"
    table = f"the {target.name} table figure; --link-bandwidth for another machine"
    return links_for(target.name).host_to_device, table


@lru_cache(maxsize=1)
def _host_copy_bandwidth() -> float:
    """Bytes/s of a large host copy (read + write counted once), best of a few."""
    src = torch.empty(16 * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return src.numel() / best


@lru_cache(maxsize=1)
def _cpu_op_seconds() -> float:
    """Fixed cost of one small eager op with autograd on this CPU (dispatch, allocation)."""
    x = torch.zeros(8, requires_grad=True)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        y = x
        for _ in range(100):
            y = y * 1.0
        best = min(best, (time.perf_counter() - start) / 100)
    return best
