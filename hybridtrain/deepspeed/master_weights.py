"""DeepSpeed's bf16 and fp16 math: half module weights, fp32 master weights in the optimizer.

With ``bf16.enabled`` or ``fp16.enabled`` DeepSpeed 0.19.8 does not autocast: it casts the
module's parameters to the half dtype (``engine._cast_module_mixed_precision``; buffers keep
their dtype), lets autograd accumulate their gradients in it (``data_types.grad_accum_dtype``
unset: the model's dtype), and its optimizer wrapper keeps fp32 masters of them. At the
accumulation boundary it checks the half gradients for inf/NaN, widens them to fp32, measures
their global norm, unscales and clips them in one multiplication (``combined = scale``, or
``clip * scale`` with ``clip = (norm / scale + 1e-6) / gradient_clipping`` above 1), steps the
basic optimizer on the masters and copies them back into the half weights. fp16 multiplies the
loss by the loss scale before backward (:mod:`hybridtrain.deepspeed.loss_scale`; bf16's scale
is 1), and the scale is updated before the gradients are unscaled, so a step at which the scale
grows divides them by the grown scale, as DeepSpeed's wrappers do.

A step whose gradients are not finite is skipped: the masters and weights stay, the gradients
are dropped, the scale shrinks (fp16), and the caller (:class:`~hybridtrain.deepspeed.engine.
DeepSpeedEngine`) holds the LR schedule back a step and counts it skipped, as DeepSpeed's
engine does for every wrapper here (ZeRO-1/2 bf16 too: ``bf16.check_grad_overflow`` is on by
default).

The wrappers differ in the norm's arithmetic (:data:`NormRule`), the loss scale's update rule
(:data:`~hybridtrain.deepspeed.loss_scale.ScaleRule`) and one step:

- ``fused``: ZeRO stage 0 over DeepSpeed's ``FusedAdam`` (``runtime/fp16/fused_optimizer.py``
  ``FP16_Optimizer``): each flat fp32 group gradient's fp32 norm, squares summed in Python floats
  (``get_flattened_grad_norm``).
- ``unfused``: ZeRO stage 0 over any other optimizer (``unfused_optimizer.py``
  ``FP16_UnfusedOptimizer``): each half gradient's fp32 norm, squares summed in an fp32 tensor
  (``get_weight_norm``). Both stage-0 wrappers step the basic optimizer once with zero gradients
  when built (``initialize_optimizer_states``, decided by
  :func:`hybridtrain.deepspeed.building.takes_fp16_init_step`).
- ``zero``: ZeRO stages 1 and 2 (``runtime/zero/stage_1_and_2.py`` ``DeepSpeedZeroOptimizer``):
  each half gradient's norm in fp64, squares summed and rooted in fp32
  (``get_grad_norm_direct``), groups combined by an fp32 vector norm
  (``combine_grad_norm_groups``); the combined scale an fp32 tensor (``torch.clamp(clip, min=1.0)
  * scale``).

The reported gradient norm is the global norm divided by the scale the loss was multiplied by
(ZeRO-1/2's ``scaled_global_grad_norm / prev_scale``). DeepSpeed 0.19.8's engine never calls
the stage-0 fp16 wrappers' ``backward`` (only a ZeRO optimizer's ``scale_if_loss``), so on the
real one their gradients are not scaled and are then divided by the scale anyway: clipping
never acts and an SGD step is 2**16 times too small. The drop-in scales the loss as those
wrappers' ``backward`` does (``loss.float() * cur_scale``) instead, and reports the norm of the
unscaled gradients for them too.

DeepSpeed's masters are flat per group (``fused`` and ``zero``) or one per parameter
(``unfused``); they are one per parameter here, which is the same arithmetic for the
element-wise updates (Adam, AdamW) these wrappers run.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.distributed as dist

from hybridtrain.checkpoint.training_state import MASTER
from hybridtrain.deepspeed.loss_scale import DeepSpeedLossScale
from hybridtrain.deepspeed.master_shards import MasterShards
from hybridtrain.deepspeed.zero_gradients import Averaging, ZeroGradients, average_in_place, zero_global_norm

NormRule = Literal["fused", "unfused", "zero"]
"""Which DeepSpeed wrapper's norm and clip arithmetic (see the module)."""


def global_norm(rule: NormRule, groups: list[list[torch.Tensor]]) -> float:
    """The global norm of the half gradients ``groups`` (one list per parameter group) as
    DeepSpeed's wrapper ``rule`` computes it (see the module)."""
    if rule == "fused":
        total = 0.0
        for grads in groups:
            if grads:
                total += float(torch.cat([g.reshape(-1).float() for g in grads]).norm(2)) ** 2
        norm = float(torch.tensor([total], dtype=torch.float32)[0]) ** 0.5
        return math.sqrt(norm**2.0)
    if rule == "unfused":
        total_sq = 0.0
        for grads in groups:
            group: Any = 0.0
            for g in grads:
                group = group + g.float().norm(2) ** 2  # an fp32 tensor sum, as get_weight_norm
            group_norm = float(torch.tensor([float(group)], dtype=torch.float32)[0]) ** 0.5
            total_sq += group_norm**2.0
        return math.sqrt(total_sq)
    return zero_global_norm(groups)


def combined_scale(rule: NormRule, norm: float, max_norm: float, scale: float = 1.0) -> float | torch.Tensor:
    """What DeepSpeed's wrapper ``rule`` divides the gradients by to unscale them from the loss
    scale ``scale`` and clip them to ``max_norm`` (0: no clipping) in one multiplication, given
    their global norm ``norm`` (of the scaled gradients). ``zero``'s is an fp32 tensor when it
    clips, as DeepSpeed's."""
    if rule == "zero":
        if max_norm <= 0:
            return scale
        clip_tensor = ((torch.tensor(norm, dtype=torch.float32) / scale) + 1e-6) / max_norm
        return torch.clamp(clip_tensor, min=1.0) * scale
    if max_norm > 0:
        clip = ((norm / scale) + 1e-6) / max_norm
        if clip > 1:
            return clip * scale
    return scale


def scaled_in_backward(loss: torch.Tensor, scale: float) -> torch.Tensor:
    """``loss`` (a view of it) whose backward multiplies the gradient reaching it by ``scale``
    in the loss's dtype, as DeepSpeed's ``loss * cur_scale`` does: the value reported and
    checked stays the unscaled loss, and an fp16 loss sees the scale rounded to fp16 (2**16
    overflows there, as in DeepSpeed)."""
    view = loss.view_as(loss)
    if view.requires_grad:
        view.register_hook(lambda grad: grad * torch.tensor(scale, dtype=grad.dtype, device=grad.device))
    return view


class MasterWeightsOptimizer(torch.optim.Optimizer):
    """DeepSpeed's bf16/fp16 optimizer wrapper around a basic optimizer built over the module's
    half parameters: each trainable parameter gets an fp32 master, which takes its place in the
    basic optimizer's groups; :meth:`step` checks, widens, unscales and clips the gradients as
    DeepSpeed, steps the masters and copies them back. ``param_groups`` and ``state`` are the
    basic optimizer's, so schedulers and callers that set ``lr`` on the groups drive the update.

    Args:
        inner: the basic optimizer (the config's or the caller's), over the half parameters.
        max_norm: ``gradient_clipping`` (0: none).
        rule: which DeepSpeed wrapper's norm and clip arithmetic (:data:`NormRule`).
        fp16_init_step: step the masters once with zero gradients now (the ZeRO-0 wrappers').
        loss_scale: fp16's loss scale (None: bf16, not scaled).
        averaging: several data-parallel ranks: how the gradients are averaged
            (:class:`~hybridtrain.deepspeed.zero_gradients.Averaging`; None: one process). The
            caller then runs :meth:`after_backward` after every backward. Under ZeRO-1/2
            (``rule`` ``zero``) each rank keeps its partition of the masters; under ZeRO-0 the
            whole gradients are averaged at the boundary, as DeepSpeed's engine does, and every
            rank keeps whole masters.
        offload: ZeRO-Offload (``offload_optimizer.device: cpu``, ZeRO-1/2): the masters and the
            basic optimizer's state live in host memory, the norm is summed as DeepSpeed's
            offload path sums it (:func:`~hybridtrain.deepspeed.zero_gradients.zero_global_norm`).
    """

    def __init__(self, inner: torch.optim.Optimizer, max_norm: float, rule: NormRule,
                 fp16_init_step: bool, loss_scale: DeepSpeedLossScale | None = None,
                 averaging: Averaging | None = None, offload: bool = False) -> None:
        # The base class's constructor is not run: the groups and state are the inner optimizer's.
        self.inner = inner
        self.defaults = inner.defaults
        self.max_norm = max_norm
        self.rule: NormRule = rule
        self.loss_scale = loss_scale
        self.offload = offload
        self.half_groups: list[list[torch.nn.Parameter]] = []
        self.master_groups: list[list[torch.Tensor]] = []
        self.shards: MasterShards | None = None
        """The masters' partition over the ranks (ZeRO-1/2 on several processes; None: whole)."""
        for group in inner.param_groups:
            halves = [p for p in group["params"] if p.requires_grad]
            device = torch.device("cpu") if offload else halves[0].device if halves else torch.device("cpu")
            if averaging is not None and rule == "zero" and self.shards is None:
                self.shards = MasterShards(device)
            masters = [self._new_master(p, device).requires_grad_(True) for p in halves]
            self.half_groups.append(halves)
            self.master_groups.append(masters)
            group["params"] = masters
        self.ranks: ZeroGradients | None = None
        """The gradients averaged over the data-parallel ranks (ZeRO-1/2 on several processes)."""
        self.whole_averaging: Averaging | None = None
        """How the engine averages the whole gradients at the boundary (ZeRO-0 on several processes)."""
        if averaging is not None and rule == "zero":
            self.ranks = ZeroGradients(self.half_groups, averaging, dist.get_world_size())
        elif averaging is not None:
            self.whole_averaging = averaging
        self._optimizer_step_pre_hooks: dict[int, Any] = {}
        self._optimizer_step_post_hooks: dict[int, Any] = {}
        self.last_grad_norm: float | None = None
        """The global gradient norm (before clipping, unscaled) of the latest :meth:`step`; inf
        when it was skipped."""
        self.last_step_skipped = False
        """Whether the latest :meth:`step` was skipped (gradients not finite)."""
        if fp16_init_step:
            for master in self._masters():
                master.grad = torch.zeros_like(master)
            self.inner.step()
            self._drop_master_grads()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.inner.param_groups = groups

    @property
    def state(self) -> Any:
        return self.inner.state

    @state.setter
    def state(self, state: Any) -> None:
        self.inner.state = state

    @property
    def cur_scale(self) -> float:
        """The loss scale the next backward multiplies by (1.0 for bf16), DeepSpeed's name."""
        return self.loss_scale.scale if self.loss_scale is not None else 1.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the half weights' gradients (always to None, as DeepSpeed)."""
        for halves in self.half_groups:
            for p in halves:
                p.grad = None

    @property
    def averages_gradients(self) -> bool:
        """Whether this wrapper averages the gradients over the ranks itself (several processes)."""
        return self.ranks is not None or self.whole_averaging is not None

    def scaled_for_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` with fp16's loss scale applied in its backward (:func:`scaled_in_backward`);
        bf16's as it is. The engine asks this of every micro-batch's loss before weighting it
        (:class:`hybridtrain.engine.OwnPrecision`)."""
        return scaled_in_backward(loss, self.cur_scale) if self.loss_scale is not None else loss

    def after_backward(self, boundary: bool) -> None:
        """After every backward on several ranks: average the gradients as DeepSpeed's ZeRO-1/2
        does (:meth:`ZeroGradients.after_backward`; ``boundary``: the backward ends the
        accumulation window), or under ZeRO-0 as its engine does at the ``boundary``
        (:func:`~hybridtrain.deepspeed.zero_gradients.average_in_place`); nothing on one process."""
        if self.ranks is not None:
            self.ranks.after_backward(boundary)
        elif self.whole_averaging is not None and boundary:
            average_in_place(self._halves(), self.whole_averaging, dist.get_world_size())

    def _checked_norm(self) -> float | None:
        """The global norm of the half gradients (of the averaged ones on several ranks) as the
        wrapper measures it; None when they are not finite (the step is then skipped)."""
        if self.ranks is not None:
            if self.ranks.nonfinite():
                return None
            norm = self.ranks.norm(self.offload)
        else:
            grads = [[p.grad for p in halves if p.grad is not None] for halves in self.half_groups]
            if any(not bool(torch.isfinite(g).all()) for group in grads for g in group):
                return None
            norm = zero_global_norm(grads, offload=self.offload) if self.rule == "zero" else \
                global_norm(self.rule, grads)
        return norm if math.isfinite(norm) else None

    def _master_grad(self, index: int, master: torch.Tensor, divisor: float | torch.Tensor) -> torch.Tensor:
        """Master ``index``'s gradient: its half gradient (on several ranks: the averaged one's
        shard) widened to fp32 and multiplied by ``1 / divisor`` (unscaled and clipped)."""
        if self.ranks is not None:
            local = master.to_local()  # type: ignore[attr-defined]
            widened = self.ranks.shard_grad(index).to(master.device, torch.float32).reshape(local.shape)
        else:
            half = self._halves()[index]
            if half.grad is None:
                return torch.zeros_like(master)
            widened = half.grad.to(master.device, torch.float32)
        if isinstance(divisor, torch.Tensor) or divisor != 1.0:
            widened.mul_(1.0 / divisor)
        return MasterShards.from_local(widened, master) if self.ranks is not None else widened

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Check, measure, unscale and clip, update the masters, copy them into the half weights
        (see the module); a step with gradients not finite is skipped (:meth:`skip`)."""
        if closure is not None:
            raise NotImplementedError("MasterWeightsOptimizer.step(closure) is not supported, as in DeepSpeed")
        norm = self._checked_norm()
        if norm is None:
            self.skip()
            return
        used = self.cur_scale
        if self.loss_scale is not None:
            self.loss_scale.update(overflow=False)  # before unscaling, as DeepSpeed's wrappers
        self.last_grad_norm = norm / used
        self.last_step_skipped = False
        divisor = combined_scale(self.rule, norm, self.max_norm, self.cur_scale)
        for index, master in enumerate(self._masters()):
            master.grad = self._master_grad(index, master, divisor)
        self.inner.step()
        self._drop_master_grads()
        if self.ranks is not None:
            self.ranks.clear()
        self._copy_into_halves()

    def skip(self) -> None:
        """Skip this step as DeepSpeed does on an overflow: the gradients are dropped, the loss
        scale shrinks, the masters stay (the caller holds the LR schedule back)."""
        if self.loss_scale is not None:
            self.loss_scale.update(overflow=True)
        self.last_grad_norm = float("inf")
        self.last_step_skipped = True
        self.zero_grad()
        if self.ranks is not None:
            self.ranks.clear()

    def _masters(self) -> list[torch.Tensor]:
        return [m for masters in self.master_groups for m in masters]

    def _halves(self) -> list[torch.nn.Parameter]:
        return [h for halves in self.half_groups for h in halves]

    def _drop_master_grads(self) -> None:
        for master in self._masters():
            master.grad = None

    def state_dict(self) -> dict[str, Any]:
        """The basic optimizer's state dict (over the masters); the masters themselves are saved
        by the checkpoint writer (:mod:`hybridtrain.deepspeed.checkpoint.writer`), as DeepSpeed's
        wrappers keep them beside it, and restored by :meth:`load_masters`."""
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the basic optimizer's state dict (see :meth:`state_dict`); a ``master`` entry
        of a parameter's state (the engine's own checkpoints, :class:`hybridtrain.checkpoint.
        training_state.KeepsMasters`) sets that master and its half weight."""
        entries = state_dict.get("state", {})
        masters = {index: entry[MASTER] for index, entry in entries.items() if MASTER in entry}
        inner = {index: {k: v for k, v in entry.items() if k != MASTER} for index, entry in entries.items()}
        self.inner.load_state_dict({**state_dict, "state": {i: e for i, e in inner.items() if e}})
        if masters:
            with torch.no_grad():
                for index, master in enumerate(self._masters()):
                    if index in masters:
                        master.copy_(masters[index].to(master.device, torch.float32))
            self._copy_into_halves()

    def master_sources(self) -> dict[int, torch.nn.Parameter]:
        """``id(master)`` → the half parameter it updates (the engine's checkpoints key the
        masters and their optimizer state by that parameter's name)."""
        return {id(m): h for halves, masters in zip(self.half_groups, self.master_groups, strict=True)
                for h, m in zip(halves, masters, strict=True)}

    def precision_state_dict(self) -> dict[str, Any]:
        """fp16's loss scale (None for bf16 and fp32), for the engine's own checkpoints."""
        return {"loss_scale": self.loss_scale.state_dict() if self.loss_scale is not None else None}

    def load_precision_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`precision_state_dict`'s loss scale."""
        if self.loss_scale is not None and state.get("loss_scale") is not None:
            self.loss_scale.load_state_dict(state["loss_scale"])

    @torch.no_grad()
    def load_masters(self, values: list[torch.Tensor]) -> None:
        """Set the fp32 masters (in the groups' order) and the half weights from them, as
        DeepSpeed's wrappers restore a checkpoint's masters."""
        masters = self._masters()
        if len(values) != len(masters):
            raise ValueError(f"load_masters: got {len(values)} masters for {len(masters)} parameters")
        for master, value in zip(masters, values, strict=True):
            master.copy_(self._sharded(value.reshape(master.shape).to(master.device, torch.float32)))
        self._copy_into_halves()

    def _new_master(self, half: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The fp32 master of ``half`` on ``device`` (this rank's shard on several ranks)."""
        return self._sharded(half.detach().to(device, torch.float32, copy=True))

    def _sharded(self, whole: torch.Tensor) -> torch.Tensor:
        """``whole`` as the masters hold it: this rank's shard on several ranks, else itself."""
        return self.shards.shard(whole) if self.shards is not None else whole

    @torch.no_grad()
    def _copy_into_halves(self) -> None:
        """Each half weight from its master (gathered whole on several ranks)."""
        for halves, masters in zip(self.half_groups, self.master_groups, strict=True):
            for half, master in zip(halves, masters, strict=True):
                half.copy_(MasterShards.whole(master, half.dtype) if self.shards is not None else master)

    def __repr__(self) -> str:
        return f"MasterWeightsOptimizer({self.inner!r})"


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating-point parameters (not the buffers) to ``dtype`` in place, as
    DeepSpeed's ``_cast_module_mixed_precision`` without ``data_types.buffer_dtype``."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
