"""DeepSpeed's 1-bit Adam (``"type": "OneBitAdam"``) and 0/1 Adam (``"ZeroOneAdam"``) on one
process, step for step as DeepSpeed's python computes them
(``deepspeed/runtime/fp16/onebit/adam.py`` and ``zoadam.py``, DeepSpeed 0.19.6; the classes
left DeepSpeed's package in 0.19.8).

Both compress only the communication between processes: with one process DeepSpeed skips
every ``compressed_allreduce`` (``if self.size > 1``) and what is left is the update rule
below. Across processes that all-reduce (1-bit sign compression with worker and server
error feedback) is not implemented here, so these optimizers refuse a world size above 1.

Shared by both: the **first** ``step()`` call only sets up state (each tensor's ``step``
count becomes 1; nothing moves). DeepSpeed's fp16 wrapper spends that call when it is built
(see :func:`hybridtrain.optim.take_fp16_init_step`); without fp16 the first training step
is spent on it. Neither corrects bias nor honours ``eps_inside_sqrt`` (both are accepted
and ignored, as in DeepSpeed); weight decay joins the update: ``u = m/(√v + ε) + λ·p``,
``p ← p − lr·u``.

1-bit Adam: plain (uncorrected) Adam while ``step < freeze_step``; from then on the
variance is frozen and only the momentum follows the gradient (masked by a group's
``exp_avg_mask`` where given).

0/1 Adam: before ``var_freeze_step`` the moments are updated only on steps that are
multiples of ``var_interval`` (which doubles every ``var_update_scaler`` such updates); on
the others the gradient is not used on one process, and the update reuses the moments.
After it, the momentum follows every gradient and every ``local_step_interval`` steps the
local updates are replaced by the momentum-synchronised one (``local_step_interval``
doubles every ``local_step_scaler`` steps, up to ``local_step_clipper``).

Flags DeepSpeed keeps on the optimizer object (frozen or not) are derived from the step
counts here, so a checkpoint resumes exactly.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

COMM_BACKENDS = ("nccl", "mpi", "hccl", "compressed")


def require_one_process(name: str) -> None:
    """Refuse a world size above 1 (the compressed all-reduce is not implemented).

    Raises:
        ValueError: one line naming the optimizer.
    """
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() \
        else int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise ValueError(f"optimizer.type = {name!r} runs on one process here (world size {world}): its 1-bit "
                         "compressed all-reduce with error feedback across processes is not implemented; "
                         "use Adam (or Lamb) for data parallel")


def onebit_defaults(name: str, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                    amsgrad: bool, comm_backend_name: str) -> dict[str, Any]:
    """Validate what the 1-bit optimizers share; their group defaults.

    Raises:
        ValueError: amsgrad, an unknown ``comm_backend_name``, or a world size above 1.
    """
    if amsgrad:
        raise ValueError(f"optimizer.params.amsgrad = True: DeepSpeed's {name} does not support AMSGrad")
    if comm_backend_name not in COMM_BACKENDS:
        raise ValueError(f"optimizer.params.comm_backend_name = {comm_backend_name!r}; DeepSpeed allows "
                         + ", ".join(COMM_BACKENDS))
    require_one_process(name)
    beta1, beta2 = betas
    return {"lr": lr, "betas": (beta1, beta2), "eps": eps, "weight_decay": weight_decay}


class OneProcessOptimizer(torch.optim.Optimizer):
    """What DeepSpeed's 1-bit optimizers share on one process: the closure, the set-up first
    call, the tensors with a gradient, and the step count DeepSpeed reads its stage from."""

    def _tensors(self) -> list[tuple[dict[str, Any], torch.Tensor]]:
        return [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]

    def _first_step_count(self) -> int | None:
        """The step count of the first parameter with state (DeepSpeed reads one tensor's)."""
        for group in self.param_groups:
            for p in group["params"]:
                if self.state[p]:
                    return int(self.state[p]["step"])
        return None

    @staticmethod
    def _closure_loss(closure: Callable[[], float] | None) -> float | None:
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _setup_call(self, init: Callable[[torch.Tensor], dict[str, Any]]) -> bool:
        """DeepSpeed's first ``step()``: state for every tensor with a gradient, its count 1,
        no update. Returns whether this call was it."""
        if self._first_step_count() is not None:
            return False
        for _, p in self._tensors():
            self.state[p].update(init(p))
            self.state[p]["step"] = 1
        return True


class OnebitAdam(OneProcessOptimizer):
    """DeepSpeed's ``OnebitAdam`` on one process (see the module docstring).

    Args:
        params: parameters or parameter groups (a group may carry ``exp_avg_mask``).
        lr / betas / eps / weight_decay: as in DeepSpeed (weight decay inside the update).
        freeze_step: steps of plain Adam before the variance freezes.
        bias_correction / eps_inside_sqrt / max_grad_norm / cuda_aware: accepted, unused (as
            in DeepSpeed's class; DeepSpeed's engine refuses ``max_grad_norm`` earlier).
        comm_backend_name: nccl, mpi, hccl or compressed (communication only).

    Raises:
        ValueError: amsgrad, an unknown backend, or a world size above 1.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                 amsgrad: bool = False, cuda_aware: bool = False, comm_backend_name: str = "nccl") -> None:
        defaults = onebit_defaults("OneBitAdam", lr, betas, eps, weight_decay, amsgrad, comm_backend_name)
        super().__init__(params, defaults)
        self.freeze_step = freeze_step

    @staticmethod
    def _fresh(p: torch.Tensor) -> dict[str, Any]:
        return {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One DeepSpeed 1-bit Adam step (the first call only sets up state)."""
        loss = self._closure_loss(closure)
        if self._setup_call(self._fresh):
            return loss
        count = self._first_step_count()
        # DeepSpeed decides at the end of a step after the set-up one: the first is never frozen.
        frozen = count is not None and count >= max(self.freeze_step, 2)
        for group, p in self._tensors():
            state = self.state[p]
            if not state:
                state.update(self._fresh(p), step=0)
            beta1, beta2 = group["betas"]
            exp_avg, exp_avg_sq, grad = state["exp_avg"], state["exp_avg_sq"], p.grad
            state["step"] += 1
            exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
            if not frozen or group.get("non_freeze") is True:
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            elif "exp_avg_mask" in group:  # frozen: the variance stays, the momentum may be masked
                exp_avg.mul_(group["exp_avg_mask"].to(exp_avg.device))
            update = exp_avg / (exp_avg_sq.sqrt() + group["eps"])
            if group["weight_decay"] > 0.0:
                update += group["weight_decay"] * p
            p.add_(-group["lr"] * update)
        return loss


class ZeroOneAdam(OneProcessOptimizer):
    """DeepSpeed's ``ZeroOneAdam`` on one process (see the module docstring).

    Args:
        params: parameters or parameter groups.
        lr / betas / eps / weight_decay: as in DeepSpeed (weight decay inside the update).
        var_freeze_step: steps after which the variance freezes.
        var_update_scaler: variance updates between doublings of their interval.
        local_step_scaler / local_step_clipper: steps between doublings of the local-step
            interval, and its largest value.
        bias_correction / eps_inside_sqrt / max_grad_norm / cuda_aware: accepted, unused.
        comm_backend_name: nccl, mpi, hccl or compressed (communication only).

    Raises:
        ValueError: amsgrad, an unknown backend, or a world size above 1.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, var_freeze_step: int = 100000,
                 var_update_scaler: int = 16, local_step_scaler: int = 32678, local_step_clipper: int = 16,
                 amsgrad: bool = False, cuda_aware: bool = False, comm_backend_name: str = "nccl") -> None:
        defaults = onebit_defaults("ZeroOneAdam", lr, betas, eps, weight_decay, amsgrad, comm_backend_name)
        super().__init__(params, defaults)
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper

    @staticmethod
    def _fresh(p: torch.Tensor) -> dict[str, Any]:
        return {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p), "var_interval": 1,
                "var_counter": 0, "local_step_interval": 1, "local_step_counter": 0, "lrs": 0.0,
                "momentum_accumulator": torch.zeros_like(p)}

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One DeepSpeed 0/1 Adam step (the first call only sets up state)."""
        loss = self._closure_loss(closure)
        if self._setup_call(self._fresh):
            return loss
        count = self._first_step_count()
        # DeepSpeed freezes after a step that ends with the first tensor's count above it.
        frozen = count is not None and count > self.var_freeze_step and count >= 2
        for group, p in self._tensors():
            state = self.state[p]
            if not state:
                state.update(self._fresh(p), step=0)
            self._step_one(group, p, state, frozen)
        return loss

    def _step_one(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any], frozen: bool) -> None:
        beta1, beta2 = group["betas"]
        lr, eps = group["lr"], group["eps"]
        exp_avg, exp_avg_sq, buffer, grad = state["exp_avg"], state["exp_avg_sq"], state["momentum_accumulator"], p.grad
        state["step"] += 1
        if not frozen:
            # Off the variance steps the gradient would travel 1-bit compressed; one process skips it.
            if state["step"] % state["var_interval"] == 0:
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        else:
            exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
            state["lrs"] += lr
        update = exp_avg / (exp_avg_sq.sqrt() + eps)
        if group["weight_decay"] > 0.0:
            update += group["weight_decay"] * p
        p.add_(-lr * update)
        if frozen:
            buffer.add_(-lr * update)
        if frozen and state["step"] % state["local_step_interval"] == 0:
            # Undo the local steps and redo them from the (here: local) momentum.
            p.add_(-1 * buffer)
            buffer.mul_(exp_avg_sq.sqrt() + eps)  # DeepSpeed masks only what crossed processes
            exp_avg.zero_().add_(buffer / state["lrs"], alpha=-1)
            p.add_(buffer / (exp_avg_sq.sqrt() + eps))
            buffer.zero_()
            state["lrs"] = 0.0
        if not frozen:
            if state["step"] % state["var_interval"] == 0:
                state["var_counter"] += 1
                if state["var_counter"] == self.var_update_scaler:
                    state["var_counter"] = 0
                    state["var_interval"] *= 2
        else:
            state["local_step_counter"] += 1
            if state["local_step_counter"] == self.local_step_scaler:
                state["local_step_counter"] = 0
                state["local_step_interval"] = min(self.local_step_clipper, state["local_step_interval"] * 2)
