"""DeepSpeed's bf16 math: bfloat16 module weights, fp32 master weights in the optimizer.

With ``bf16.enabled`` DeepSpeed 0.19.8 does not autocast: it casts the module's parameters
to bfloat16 (``engine._cast_module_mixed_precision``; buffers keep their dtype), lets autograd
accumulate their gradients in bfloat16 (``data_types.grad_accum_dtype`` unset: the model's
dtype), and its optimizer wrapper keeps one flat fp32 master per parameter group. At the
accumulation boundary it widens the gradients to fp32, measures their global norm, clips
(``clip = (norm + 1e-6) / gradient_clipping``, gradients divided by it when above 1), steps
the basic optimizer on the masters and copies them back into the bfloat16 weights.

Two wrappers do so and differ in the norm's arithmetic and one step:

- ZeRO stage 0: ``runtime/fp16/fused_optimizer.py`` ``FP16_Optimizer`` (``DDP_BFLOAT16``): the
  norm of each flat fp32 group gradient (``get_flattened_grad_norm``: fp32 norms, squares summed
  in Python floats); its constructor steps the basic optimizer once with zero gradients
  (``initialize_optimizer_states``, decided by :func:`hybridtrain.deepspeed.building.wrapper_step`).
- ZeRO stages 1 and 2: ``runtime/zero/stage_1_and_2.py`` ``DeepSpeedZeroOptimizer``: the norm of
  each bfloat16 gradient in fp64, squares summed and rooted in fp32 (``get_grad_norm_direct``),
  groups combined by ``combine_grad_norm_groups``; the clip factor an fp32 tensor.

:class:`MasterWeightsOptimizer` is that wrapper as an ordinary optimizer: its ``param_groups``
are the basic optimizer's (schedulers set their ``lr``), whose ``params`` are the masters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

NormRule = Callable[[list[list[torch.Tensor]], list[torch.Tensor]], float]


def flat_group_norm(half_grads: list[list[torch.Tensor]], master_grads: list[torch.Tensor]) -> float:
    """ZeRO-0's global norm (``get_flattened_grad_norm`` then ``get_global_norm``): each flat
    fp32 group gradient's fp32 norm, squares summed in Python floats, the sum rounded to fp32."""
    total = 0.0
    for grad in master_grads:
        total += float(grad.float().norm(2)) ** 2
    norm = float(torch.tensor([total], dtype=torch.float32)[0]) ** 0.5
    return math.sqrt(norm**2.0)


def partition_norm(half_grads: list[list[torch.Tensor]], master_grads: list[torch.Tensor]) -> float:
    """ZeRO-1/2's global norm (``get_grad_norm_direct`` per group, ``combine_grad_norm_groups``):
    each bfloat16 gradient's norm in fp64, squares summed in fp32 and rooted; groups combined
    by an fp32 vector norm."""
    groups = []
    for grads in half_grads:
        if grads:
            norms = torch.stack([torch.linalg.vector_norm(g.detach().double(), ord=2) for g in grads])
            groups.append(norms.pow(2).sum().float().pow(0.5))
        else:
            groups.append(torch.zeros((), dtype=torch.float32))
    return float(torch.linalg.vector_norm(torch.stack(groups), ord=2))


def clip_divisor(norm: float, max_norm: float, zero: bool) -> float:
    """What DeepSpeed divides the gradients by to clip them to ``max_norm`` (1.0: no clipping);
    ZeRO-1/2 computes it as an fp32 tensor (``torch.clamp(clip, min=1.0)``), ZeRO-0 in Python."""
    if max_norm <= 0:
        return 1.0
    if zero:
        clip = (torch.tensor(norm, dtype=torch.float32) + 1e-6) / max_norm
        return float(torch.clamp(clip, min=1.0))
    clip = (norm + 1e-6) / max_norm
    return clip if clip > 1 else 1.0


class MasterWeightsOptimizer(torch.optim.Optimizer):
    """DeepSpeed's bf16 optimizer wrapper around a basic optimizer built over the module's
    bfloat16 parameters: each of its groups gets one flat fp32 master of its trainable
    parameters; :meth:`step` widens the gradients, clips as DeepSpeed, steps the masters and
    copies them back. ``param_groups`` and ``state`` are the basic optimizer's.

    Args:
        inner: the basic optimizer (the config's or the caller's), over the half parameters.
        max_norm: ``gradient_clipping`` (0: none).
        zero: ZeRO stage 1/2's norm and clip arithmetic, else stage 0's (see the module).
        zero_gradient_step: step the masters once with zero gradients now (ZeRO-0's wrapper).
    """

    def __init__(self, inner: torch.optim.Optimizer, max_norm: float, zero: bool, zero_gradient_step: bool) -> None:
        # The base class's constructor is not run: the groups and state are the inner optimizer's.
        self.inner = inner
        self.defaults = inner.defaults
        self.max_norm = max_norm
        self.zero = zero
        self.half_groups: list[list[torch.nn.Parameter]] = []
        self.masters: list[torch.Tensor] = []
        for group in inner.param_groups:
            halves = [p for p in group["params"] if p.requires_grad]
            master = torch.cat([p.detach().reshape(-1).float() for p in halves]) if halves else \
                torch.zeros(0, dtype=torch.float32)
            master.requires_grad_(True)
            self.half_groups.append(halves)
            self.masters.append(master)
            group["params"] = [master]
        self._optimizer_step_pre_hooks: dict[int, Any] = {}
        self._optimizer_step_post_hooks: dict[int, Any] = {}
        self.last_grad_norm: float | None = None
        """The global gradient norm (before clipping) of the latest :meth:`step`."""
        if zero_gradient_step:
            for master in self.masters:
                master.grad = torch.zeros_like(master)
            self.inner.step()
            self._drop_master_grads()

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.inner.param_groups = groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the bfloat16 weights' gradients (always to None, as DeepSpeed)."""
        for halves in self.half_groups:
            for p in halves:
                p.grad = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Widen, measure, clip, update the masters, copy them into the bfloat16 weights."""
        if closure is not None:
            raise NotImplementedError("MasterWeightsOptimizer.step(closure) is not supported, as in DeepSpeed")
        half_grads = [[p.grad for p in halves if p.grad is not None] for halves in self.half_groups]
        for master, halves in zip(self.masters, self.half_groups):
            master.grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                                     for p in halves]) if halves else torch.zeros_like(master)
        norm = (partition_norm if self.zero else flat_group_norm)(half_grads, [m.grad for m in self.masters])
        self.last_grad_norm = norm
        if not math.isfinite(norm):
            # DeepSpeed's bf16 wrappers skip a step whose norm is not finite.
            self._drop_master_grads()
            return
        divisor = clip_divisor(norm, self.max_norm, self.zero)
        if divisor != 1.0:
            for master in self.masters:
                master.grad.mul_(1.0 / divisor)  # type: ignore[union-attr]
        self.inner.step()
        self._drop_master_grads()
        for master, halves in zip(self.masters, self.half_groups):
            offset = 0
            for p in halves:
                p.copy_(master[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def _drop_master_grads(self) -> None:
        for master in self.masters:
            master.grad = None

    def state_dict(self) -> dict[str, Any]:
        """The basic optimizer's state and the fp32 masters (``fp32_flat_groups``, as DeepSpeed)."""
        return {"base_optimizer_state": self.inner.state_dict(),
                "fp32_flat_groups": [m.detach().clone() for m in self.masters]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (masters copied into place)."""
        self.inner.load_state_dict(state_dict["base_optimizer_state"])
        for master, saved in zip(self.masters, state_dict["fp32_flat_groups"]):
            with torch.no_grad():
                master.copy_(saved)

    def __repr__(self) -> str:
        return f"MasterWeightsOptimizer({self.inner!r})"


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating-point parameters (not the buffers) to ``dtype`` in place, as
    DeepSpeed's ``_cast_module_mixed_precision`` without ``data_types.buffer_dtype``."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
