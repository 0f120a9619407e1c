"""DeepSpeed ZeRO-3's bf16 and fp16 math: half partitioned weights, fp32 master partitions.

DeepSpeed 0.19.8's ZeRO-3 (``runtime/zero/stage3.py`` ``DeepSpeedZeroOptimizer_Stage3``) under
``bf16.enabled``/``fp16.enabled`` keeps each rank's partition of every parameter in the half dtype
and an fp32 master of that partition. Its arithmetic, and how it is reproduced here over FSDP2
(the engine's ZeRO-3: ``fully_shard`` of the half parameters, no mixed-precision policy, so the
shards, the gathered weights and the gradients are half, as DeepSpeed's):

- backward: each micro-batch's half gradient is reduce-scattered in the half dtype
  (``communication_data_type`` defaults to the model's), pre-divided by the world size
  (``reduce_scatter_coalesced``: ``div_(world_sz)`` before the sum) and added to the rank's half
  gradient partition (``gradient_accumulation_dtype`` is the model's). FSDP2 reduce-scatters the
  half gradient averaged over the ranks and adds it to the half shard's gradient: a division by a
  power of two commutes with rounding, so for 1, 2, 4… ranks it is the same value.
- ``step``: fp16 first checks the accumulated partitions for inf/NaN on every rank
  (``has_overflow``, an all-reduce MAX); then the norm: each parameter partition's gradient norm in
  fp64, squared and summed per parameter group, all-reduced (SUM) and rooted in fp64
  (``get_grad_norm_direct``), the groups combined by ``combine_grad_norm_groups`` (an fp64 vector
  norm; a non-finite one counts as an overflow, bf16 included). The loss scale is updated before
  anything reads it (``_loss_scale_update_and_overflow_cleanup``), so the reported norm
  (``scaled_norm / loss_scale``) and the unscaling use the updated scale. Each fp32 master
  partition's gradient is the half one widened, multiplied by ``1 / combined`` with ``combined =
  clamp(((norm / scale) + 1e-6) / clip, min=1) * scale`` kept in fp64 (``unscale_and_clip_grads``),
  the basic optimizer steps the masters and they are copied back into the half partitions.
- no fp16 init step (``initialize_optimizer_states`` only makes zero gradients).

With ``offload_optimizer.device: cpu`` the fp32 master partitions, their gradients and the basic
optimizer's state live in host memory (``fp32_partitioned_groups_flat`` on the CPU, the optimizer
stepped there), and two things change in the arithmetic (``complete_grad_norm_calculation_for_cpu_offload``):
each parameter partition's norm is taken in fp64 at the accumulation boundary (``_constant_buffered_norm2``:
the norm squared, then rooted), the squares summed in fp64 per group, but that sum is put in an
**fp32** tensor before the all-reduce (SUM) and the root, and the groups' norms are combined in
fp32; so the reported norm, the clip factor and ``1 / combined`` are fp32 (:func:`stage3_offload_norm`).
Accumulation, the overflow check and the update are as without offload. ``offload_param.device:
cpu`` moves the half partitions to the host (gathered to the device per use): FSDP2's
``CPUOffloadPolicy`` does the same for the half shards on several processes; the arithmetic is
unchanged (the real DeepSpeed gives the same bits with and without it).

DeepSpeed cuts every flattened parameter into equal parts, FSDP2 along its first dimension: the
element-wise update (Adam, AdamW) is the same per element; only the per-rank partial norms are
summed in another grouping (fp64, far below fp32's resolution).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybridtrain.config import Config
from hybridtrain.deepspeed.loss_scale import DeepSpeedLossScale
from hybridtrain.deepspeed.master_shards import MasterShards
from hybridtrain.deepspeed.master_weights import MasterWeightsOptimizer, cast_parameters
from hybridtrain.deepspeed.runtime.zero import partitioning
from hybridtrain.engine import Engine
from hybridtrain.optim import FP16_INIT_STEP


def engine_config(model: torch.nn.Module, cfg: Config) -> Config:
    """Cast ``model``'s floating parameters to the half dtype (buffers keep theirs, as DeepSpeed's
    ``_cast_module_mixed_precision``) and return the config the engine then runs: ZeRO-3 kept, no
    autocast, no loss scaling or clipping of its own (:class:`Stage3MasterWeights` does them), a
    non-finite loss skipped (the wrapper then counts an overflow, as DeepSpeed's norm check would)."""
    cast_parameters(model, torch.float16 if cfg.fp16.enabled else torch.bfloat16)
    params = {**cfg.optimizer.params, FP16_INIT_STEP: False}
    zero = cfg.zero_optimization
    # The wrapper keeps the masters and the optimizer on the host (DeepSpeed's optimizer offload,
    # which leaves the half partitions on the device); offload_param stays the engine's.
    kept = zero.model_copy(update={"offload_optimizer": zero.offload_optimizer.model_copy(update={"device": "none"})})
    return cfg.model_copy(update={"bf16": cfg.bf16.model_copy(update={"enabled": False}),
                                  "fp16": cfg.fp16.model_copy(update={"enabled": False}),
                                  "gradient_clipping": 0.0, "nonfinite_loss": "skip", "zero_optimization": kept,
                                  "optimizer": cfg.optimizer.model_copy(update={"params": params})})


def set_aside_partitions(model: torch.nn.Module, cfg: Config) -> partitioning.Partitions | None:
    """A model built under ``zero.Init`` keeps its partitions through ``initialize`` on several
    processes: set aside here (:func:`.partitioning.hold_partitions`, the parameters left as
    placeholders of ``cfg``'s half dtype), the engine shards the placeholders, and
    :func:`wrap_optimizer` fills the shards, so the model is never whole on a rank. On one process
    (the engine shards nothing) or partly partitioned, it is gathered whole (None)."""
    half = torch.float16 if cfg.fp16.enabled else torch.bfloat16
    held = partitioning.hold_partitions(model, half) if _world() > 1 else None
    if held is None:
        partitioning.make_whole(model)
        cast_parameters(model, half)
    return held


def wrap_optimizer(engine: Engine, cfg: Config, consecutive_hysteresis: bool,
                   held: partitioning.Partitions | None = None) -> None:
    """Put :class:`Stage3MasterWeights` over ``engine``'s optimizer (built over the half shards),
    with ``cfg``'s clipping and, for fp16, its loss scale kept by ZeRO's rule; ``held``: the
    partitions :func:`set_aside_partitions` kept, loaded into the shards first."""
    if held is not None:
        partitioning.load_partitions(engine.module, held)
    scale = DeepSpeedLossScale.from_config("zero", cfg.fp16, consecutive_hysteresis) if cfg.fp16.enabled else None
    offload = cfg.zero_optimization.offload_optimizer.device == "cpu"
    engine.optimizer = Stage3MasterWeights(engine.optimizer, cfg.gradient_clipping, scale, offload=offload)


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (a DTensor shard's local tensor, else the tensor itself)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
    """``tensor`` all-reduced in place over the default group (nothing on one process). A host
    tensor (a flag, an offloaded sum) goes through the accelerator when the group's backend takes
    none (NCCL), as DeepSpeed makes these on its accelerator."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return tensor
    accelerator = torch.accelerator.current_accelerator()
    if tensor.device.type == "cpu" and "gloo" not in str(dist.get_backend()) and accelerator is not None:
        moved = tensor.to(torch.device(accelerator.type, torch.accelerator.current_device_index()))
        dist.all_reduce(moved, op=op)
        return tensor.copy_(moved)
    dist.all_reduce(tensor, op=op)
    return tensor


def _widened_grad(half: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """``half``'s gradient in fp32 where ``master`` lives (zeros without one): on a host mesh of its
    own (offloaded shards), the local gradient shard moved there."""
    if half.grad is None:
        return torch.zeros_like(master)
    grad = half.grad
    if isinstance(grad, DTensor) and isinstance(master, DTensor) and grad.device_mesh is not master.device_mesh:
        return MasterShards.from_local(grad.to_local().to(master.device, torch.float32), master)
    return grad.to(master.device, torch.float32)


def any_rank_overflows(grads: list[torch.Tensor]) -> bool:
    """Whether a gradient partition on any rank holds inf or NaN (DeepSpeed ZeRO-3's fp16
    ``has_overflow``: an all-reduce MAX of each rank's flag)."""
    local = any(not bool(torch.isfinite(g).all()) for g in grads)
    return bool(_all_reduce(torch.tensor([int(local)], dtype=torch.uint8), dist.ReduceOp.MAX)[0])


def _combined_norm(norms: list[torch.Tensor]) -> torch.Tensor:
    """The groups' norms (-1 where one was not finite) combined as DeepSpeed ZeRO-3 does: their
    2-norm, inf when any was not finite."""
    stacked = torch.stack(norms)
    combined = torch.linalg.vector_norm(stacked, ord=2.0)
    invalid = (~torch.isfinite(stacked) | (stacked < 0)).any()
    return torch.where(invalid, torch.full_like(combined, float("inf")), combined)


def stage3_global_norm(groups: list[list[torch.Tensor]]) -> torch.Tensor:
    """The global gradient norm (an fp64 tensor; inf when not finite) of this rank's gradient
    partitions ``groups`` (one list per parameter group), as DeepSpeed ZeRO-3 computes it (see
    the module): a collective, every rank calls it."""
    norms = []
    for grads in groups:
        if grads:
            total = torch.sum(torch.pow(torch.stack([g.to(torch.float64).norm(2.0) for g in grads]), 2.0))
        else:
            total = torch.tensor(0.0, dtype=torch.float64)
        total = _all_reduce(total.reshape(1), dist.ReduceOp.SUM)[0] ** (1.0 / 2.0)
        norms.append(torch.where(total.isinf() | total.isnan(), torch.tensor(-1.0, dtype=torch.float32), total))
    return _combined_norm(norms)


def stage3_offload_norm(groups: list[list[torch.Tensor]]) -> torch.Tensor:
    """The global gradient norm (an fp32 tensor; inf when not finite) of this rank's gradient
    partitions ``groups`` as DeepSpeed ZeRO-3 computes it with the optimizer offloaded (see the
    module): per group, each partition's fp64 norm squared and rooted, their squares summed in
    fp64, then in fp32 all-reduced and rooted; the groups combined in fp32. A collective."""
    norms = []
    for grads in groups:
        total: float | torch.Tensor = 0.0
        for grad in grads:
            partition_norm = (grad.to(torch.float64).norm(2.0) ** 2.0) ** 0.5  # _constant_buffered_norm2
            total = total + partition_norm**2
        summed = _all_reduce(torch.tensor([float(total)], dtype=torch.float32), dist.ReduceOp.SUM)[0] ** (1.0 / 2.0)
        norms.append(summed.masked_fill(summed.isinf() | summed.isnan(), -1.0))
    return _combined_norm(norms)


def stage3_combined_scale(norm: torch.Tensor, max_norm: float, scale: float) -> float | torch.Tensor:
    """What DeepSpeed ZeRO-3 multiplies the fp32 gradients by the inverse of: the loss scale
    ``scale``, times the clip factor (an fp64 tensor, at least 1) when ``max_norm`` > 0."""
    if max_norm <= 0:
        return scale
    clip = ((norm / scale) + 1e-6) / max_norm
    return torch.clamp(clip, min=1.0) * scale


class Stage3MasterWeights(MasterWeightsOptimizer):
    """DeepSpeed ZeRO-3's bf16/fp16 optimizer over the engine's optimizer of the half parameter
    shards (FSDP2 DTensors across processes, whole tensors on one): fp32 masters of each rank's
    shards take their place in the optimizer's groups, and :meth:`step` follows ``stage3.py``
    (see the module). Same arguments as :class:`MasterWeightsOptimizer` (no init step: ZeRO-3
    takes none); its ``rule`` is ``zero``, whose loss-scale rule ZeRO-3 shares. ``offload``: the
    fp32 master shards and the optimizer state in host memory, the norm as DeepSpeed's offload
    path takes it (:func:`stage3_offload_norm`)."""

    def __init__(self, inner: torch.optim.Optimizer, max_norm: float, loss_scale: Any = None,
                 offload: bool = False) -> None:
        self._host_mesh: Any = None
        super().__init__(inner, max_norm, "zero", fp16_init_step=False, loss_scale=loss_scale, offload=offload)

    def _new_master(self, half: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Offloaded, a half shard's fp32 master is this rank's shard on a host mesh of the same
        ranks (a gloo group), so that the masters' collectives (checkpoints' gathers) run on the
        host whatever the device's backend; else the shard widened where it is."""
        if not (self.offload and isinstance(half, DTensor)):
            return super()._new_master(half, device)
        if self._host_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            ranks = dist.get_process_group_ranks(half.device_mesh.get_group())
            self._host_mesh = DeviceMesh.from_group(dist.new_group(ranks, backend="gloo"), "cpu")
        local = half.to_local().detach().to(device, torch.float32, copy=True)
        return DTensor.from_local(local, self._host_mesh, half.placements, run_check=False, shape=half.shape,
                                  stride=half.stride())

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Check, measure, unscale and clip, update the master shards and copy them into the half
        shards, as DeepSpeed ZeRO-3's ``step``; a skipped step (:meth:`skip`) leaves them. A
        collective: every rank calls it."""
        if closure is not None:
            raise NotImplementedError("Stage3MasterWeights.step(closure) is not supported, as in DeepSpeed")
        grads = [[_local(p.grad) for p in halves if p.grad is not None] for halves in self.half_groups]
        # fp16 checks the partitions first; bf16 only through the norm (ZeRO-3 checks fp16 alone).
        overflow = self.loss_scale is not None and any_rank_overflows([g for group in grads for g in group])
        norm = None if overflow else (stage3_offload_norm if self.offload else stage3_global_norm)(grads)
        if norm is None or not math.isfinite(float(norm)):
            self.skip()
            return
        if self.loss_scale is not None:
            self.loss_scale.update(overflow=False)  # before reading it, as _loss_scale_update_and_overflow_cleanup
        scale = self.cur_scale
        self.last_grad_norm = float(norm / scale)
        self.last_step_skipped = False
        combined = stage3_combined_scale(norm, self.max_norm, scale)
        for halves, masters in zip(self.half_groups, self.master_groups, strict=True):
            for half, master in zip(halves, masters, strict=True):
                master.grad = _widened_grad(half, master)
                _local(master.grad).mul_(1.0 / combined)
        self.zero_grad()  # the half gradients are dropped before the update, as DeepSpeed's step
        self.inner.step()
        self._drop_master_grads()
        for halves, masters in zip(self.half_groups, self.master_groups, strict=True):
            for half, master in zip(halves, masters, strict=True):
                _local(half).copy_(_local(master))

    @torch.no_grad()
    def load_masters(self, values: list[torch.Tensor]) -> None:
        """Set the fp32 master shards from whole values (in the groups' order; every rank holds
        them all and cuts its own shards, nothing is communicated) and the half shards from them,
        as DeepSpeed ZeRO-3 restores its fp32 partitions and then its half ones."""
        masters = self._masters()
        if len(values) != len(masters):
            raise ValueError(f"load_masters: got {len(values)} masters for {len(masters)} parameters")
        for master, value in zip(masters, values, strict=True):
            _local(master).copy_(_local(partitioning.shard_like(value.reshape(master.shape), master)))
        for halves, group in zip(self.half_groups, self.master_groups, strict=True):
            for half, master in zip(halves, group, strict=True):
                _local(half).copy_(_local(master))

    def __repr__(self) -> str:
        return f"Stage3MasterWeights({self.inner!r})"
