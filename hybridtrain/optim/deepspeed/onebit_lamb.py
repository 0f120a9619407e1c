"""DeepSpeed's 1-bit LAMB (``"type": "OneBitLamb"``) on one process, step for step as
DeepSpeed's python computes it (``deepspeed/runtime/fp16/onebit/lamb.py``, DeepSpeed
0.19.6). As with 1-bit Adam (:mod:`hybridtrain.optim.deepspeed.onebit_adam`), one process skips
every compressed all-reduce, the first ``step()`` call only sets up state, and bias
correction and ``eps_inside_sqrt`` are ignored.

Warm-up (``step < freeze_step``), per tensor: LAMB without bias correction, ``u = m/(√v + ε)
+ λ·p``, trust ratio ``c = ‖p‖/‖u‖`` clamped to ``[min_coeff, max_coeff]``, ``p ← p − lr·c·u``;
every ``c ≠ 1`` also feeds a running average ``c̄ ← coeff_beta·c̄ + (1 − coeff_beta)·c``; at
``step == freeze_step`` a copy of ``v`` starts as the "fresh" variance ``v′``.

Compression stage: ``v`` is frozen. Each momentum is scaled by a fixed per-tensor factor
(the mean over tensors of ``‖m‖/√n`` divided by its own, taken once at the first
compressed step), updated, and scaled back; the gradient is reconstructed from the
momentum change and feeds ``v′``. The coefficient is the frozen ``c̄`` times a factor
``max(d/d′)`` (``d = √v + ε``, ``d′ = √v′ + ε``, blended towards 1 by
``‖m/d‖/‖u‖`` when weight decay is on), clamped to ``[factor_min, factor_max]`` and to
within ``factor_threshold`` of the previous step's factor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from hybridtrain.optim.deepspeed.onebit_adam import OneProcessOptimizer, onebit_defaults


def _norm(t: torch.Tensor) -> torch.Tensor:
    return t.pow(2).sum().sqrt()  # DeepSpeed's own spelling, for the same rounding


class OnebitLamb(OneProcessOptimizer):
    """DeepSpeed's ``OnebitLamb`` on one process (see the module docstring).

    Args:
        params: parameters or parameter groups (a group may carry ``exp_avg_mask``).
        lr / betas / eps / weight_decay: as in DeepSpeed.
        freeze_step: warm-up steps before the compression stage.
        max_coeff / min_coeff: bounds of the warm-up trust ratio.
        coeff_beta: averaging of the trust ratio over the warm-up.
        factor_max / factor_min / factor_threshold: bounds of the compression-stage factor.
        bias_correction / eps_inside_sqrt / max_grad_norm / cuda_aware: accepted, unused.
        comm_backend_name: nccl, mpi, hccl or compressed (communication only).

    Raises:
        ValueError: amsgrad, an unknown backend, or a world size above 1.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl", coeff_beta: float = 0.9, factor_max: float = 4.0,
                 factor_min: float = 0.5, factor_threshold: float = 0.1) -> None:
        defaults = onebit_defaults("OneBitLamb", lr, betas, eps, weight_decay, amsgrad, comm_backend_name)
        # DeepSpeed filters out empty tensors: their ‖m‖/√n would be 0/0.
        groups = list(params)
        if groups and isinstance(groups[0], dict):
            groups = [{**g, "params": [p for p in g["params"] if p.numel() > 0]} for g in groups]
        else:
            groups = [p for p in groups if p.numel() > 0]
        super().__init__(groups, {**defaults, "max_coeff": max_coeff, "min_coeff": min_coeff})
        self.freeze_step = freeze_step
        self.coeff_beta = coeff_beta
        self.factor_max = factor_max
        self.factor_min = factor_min
        self.factor_threshold = factor_threshold

    @staticmethod
    def _fresh(p: torch.Tensor) -> dict[str, Any]:
        return {"lamb_coeff_freeze": 0.0, "last_factor": 1.0, "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p), "exp_avg_sq_fresh": torch.zeros_like(p)}

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One DeepSpeed 1-bit LAMB step (the first call only sets up state)."""
        loss = self._closure_loss(closure)
        if self._setup_call(self._fresh):
            return loss
        count = self._first_step_count()
        # The first call after the set-up is a warm-up step whatever freeze_step says.
        frozen = count is not None and count >= max(self.freeze_step, 2)
        if frozen:
            self._compressed_step()
            return loss
        # Two passes with one device→host read between them (not three per tensor): the
        # trust ratios' inputs for every tensor, then the updates with the ratios as floats.
        todo = []
        for group, p in self._tensors():
            state = self.state[p]
            if not state:
                state.update(self._fresh(p), step=0)
            todo.append((group, p, state, self._warmup_norms(group, p, state)))
        for (group, p, state, _), (weight_norm, update_norm, ratio) in zip(todo, _read([n for *_, n in todo]),
                                                                            strict=True):
            self._warmup_apply(group, p, state, weight_norm, update_norm, ratio)
        return loss

    def _warmup_norms(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any]) -> list[torch.Tensor]:
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq, grad = state["exp_avg"], state["exp_avg_sq"], p.grad
        state["step"] += 1
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if state["step"] == self.freeze_step:
            state["exp_avg_sq_fresh"] = exp_avg_sq.detach().clone()
        weight_norm, update_norm = _norm(p), _norm(self._warmup_update(group, p, state))
        return [weight_norm, update_norm, weight_norm / update_norm]

    @staticmethod
    def _warmup_update(group: dict[str, Any], p: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + group["eps"])
        if group["weight_decay"] > 0.0:
            update += group["weight_decay"] * p
        return update

    def _warmup_apply(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any], weight_norm: float,
                      update_norm: float, ratio: float) -> None:
        coeff = 1.0
        if weight_norm != 0 and update_norm != 0:
            coeff = max(min(ratio, group["max_coeff"]), group["min_coeff"])
        if coeff != 1.0:
            state["lamb_coeff_freeze"] = self.coeff_beta * state["lamb_coeff_freeze"] + (1 - self.coeff_beta) * coeff
        p.add_(-group["lr"] * coeff * self._warmup_update(group, p, state))

    def _compressed_step(self) -> None:
        stated = [(g, p) for g in self.param_groups for p in g["params"] if self.state[p]]
        last_momentum = {id(p): self.state[p]["exp_avg"].detach().clone() for _, p in stated}
        if "scaling_coeff" not in self.state[stated[0][1]]:
            # Once, at the first compressed step: equalise the momenta's scales for compression
            # (summed group by group, as DeepSpeed does, for the same rounding).
            norms = [[torch.linalg.vector_norm(self.state[p]["exp_avg"]) / math.sqrt(p.numel())
                      for p in g["params"] if self.state[p]] for g in self.param_groups]
            flat = [s for (s,) in _read([[n] for group_norms in norms for n in group_norms])]
            sizes = [len(group_norms) for group_norms in norms]
            scales = [flat[sum(sizes[:k]):sum(sizes[:k + 1])] for k in range(len(sizes))]
            united = sum(sum(s) for s in scales) / sum(len(s) for s in scales)
            for (_, p), scale in zip(stated, flat, strict=True):
                self.state[p]["scaling_coeff"] = united / scale
        for group, p in self._tensors():
            if not self.state[p]:
                continue  # a tensor's first gradient after the warm-up: DeepSpeed has no scale for it either
            state = self.state[p]
            state["step"] += 1
            beta1 = group["betas"][0]
            state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
            state["exp_avg"].mul_(state["scaling_coeff"])
        scalars = [self._compressed_scalars(group, p, self.state[p], last_momentum[id(p)]) for group, p in stated]
        for (group, p), read in zip(stated, _read(scalars), strict=True):
            self._compressed_apply(group, p, self.state[p], *read)

    def _compressed_scalars(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any],
                            last_momentum: torch.Tensor) -> list[torch.Tensor]:
        beta1, beta2 = group["betas"]
        exp_avg, fresh = state["exp_avg"], state["exp_avg_sq_fresh"]
        exp_avg.div_(state["scaling_coeff"])
        if "exp_avg_mask" in group:
            exp_avg.mul_(group["exp_avg_mask"].to(exp_avg.device))
        grad_reconstruct = (exp_avg - last_momentum * beta1) / (1 - beta1)
        fresh.mul_(beta2).addcmul_(grad_reconstruct, grad_reconstruct, value=1 - beta2)
        denom, update_prelim, update = self._compressed_update(group, p, state)
        factor = (denom / (fresh.sqrt() + group["eps"])).max()
        if group["weight_decay"] > 0.0:
            return [factor, _norm(update_prelim) / _norm(update)]
        return [factor]

    @staticmethod
    def _compressed_update(group: dict[str, Any], p: torch.Tensor,
                           state: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        denom = state["exp_avg_sq"].sqrt() + group["eps"]
        update_prelim = state["exp_avg"] / denom
        decay = group["weight_decay"]
        return denom, update_prelim, update_prelim + decay * p if decay > 0.0 else update_prelim

    def _compressed_apply(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any], factor: float,
                          ratio: float | None = None) -> None:
        if ratio is not None:
            ratio = min(1.0, ratio)
            factor = factor * ratio + (1.0 - ratio)
        factor = max(min(factor, self.factor_max), self.factor_min)
        last = state["last_factor"]
        factor = max(min(factor, last * (1.0 + self.factor_threshold)), last * (1.0 - self.factor_threshold))
        state["last_factor"] = factor
        coeff = state["lamb_coeff_freeze"] * factor
        p.add_(-group["lr"] * coeff * self._compressed_update(group, p, state)[2])


def _read(scalars: list[list[torch.Tensor]]) -> list[list[float]]:
    """Every 0-d tensor of ``scalars`` as a float, in one device→host copy (each ``.item()``
    would wait for the device on its own)."""
    flat = [t for row in scalars for t in row]
    if not flat:
        return [[] for _ in scalars]
    values = torch.stack([t.reshape(()).to(flat[0].device) for t in flat]).tolist()
    out, k = [], 0
    for row in scalars:
        out.append(values[k:k + len(row)])
        k += len(row)
    return out
