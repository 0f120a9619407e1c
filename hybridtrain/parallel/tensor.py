"""Tensor parallel (Megatron-style) on DTensor.

Each attention and MLP is a column-parallel layer followed by a row-parallel one, so a
block needs one all-reduce in forward and one in backward per pair::

    x (replicated) ─► [W_q W_k W_v | W_fc] sharded by output columns (heads stay whole)
                    ─► local attention over this rank's heads / local activation
                    ─► [W_o | W_proj] sharded by input rows ─► partial sums ─► all-reduce

Plans live with their models (as in torchtitan): this module knows no model class. A
model brings its own by defining any of these methods, found by name:

- ``tensor_parallel_plan() -> Mapping[str, str]``: its built-in plan, module-path pattern
  (``*`` stands for one path component, ``blocks.*.attn.qkv``) → ``colwise``/``rowwise``.
- ``tensor_parallel_heads() -> Mapping[str, int]``: head counts the tensor-parallel size
  must divide, keyed by the name users know them by (``n_head``).
- ``tensor_parallel_fused_qkv() -> Sequence[str]``: patterns of the Linear layers whose
  output rows are a fused ``[Q; K; V]``.

The reference GPT defines all three. A model without them gets the plan its Hugging Face
config publishes (``base_model_tp_plan``, Llama family) and the config's
``num_attention_heads``/``num_key_value_heads``; the user's ``tensor_parallel.plan``
overrides any built-in plan. A fused ``[Q; K; V]`` weight split by plain columns would hand
rank 0 all of Q, so its rows are interleaved per rank (``[Q_0; K_0; V_0; Q_1; …]``) before
sharding, and :func:`qkv_to_user` undoes that for state dicts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def _declared(model: nn.Module, method: str) -> Any | None:
    """What the model's own ``method`` (see the module docstring) returns; ``None`` when the
    model does not define it."""
    hook = getattr(model, method, None)
    return hook() if callable(hook) else None


def _pattern(pattern: str) -> re.Pattern[str]:
    # ``*`` matches one component of a module path, never a dot.
    return re.compile("^" + r"[^.]+".join(re.escape(part) for part in pattern.split("*")) + "$")


def builtin_plan(model: nn.Module) -> dict[str, str]:
    """The plan ``model`` brings (its ``tensor_parallel_plan()``, else its Hugging Face
    config's ``base_model_tp_plan``); empty when it brings none."""
    plan = _declared(model, "tensor_parallel_plan")
    if plan is not None:
        return dict(cast(Mapping[str, str], plan))
    hf_config: Any = getattr(model, "config", None)
    hf_plan = getattr(hf_config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and not hasattr(model, prefix):
        prefix = ""
    return {f"{prefix}.{k}" if prefix else k: v for k, v in hf_plan.items()}


def resolve_plan(model: nn.Module, user_plan: Mapping[str, str], size: int) -> dict[str, str]:
    """Expand the plan's patterns to module paths and check the model can be split.

    Args:
        model: the whole model.
        user_plan: ``tensor_parallel.plan`` (empty = built-in plan).
        size: tensor-parallel degree.

    Returns:
        Module path → ``colwise``/``rowwise`` for every Linear to shard.

    Raises:
        ValueError: no plan for this model, a pattern that matches nothing or a non-Linear,
            an unsupported style, or heads / features not divisible by ``size``.
    """
    plan = dict(user_plan) or builtin_plan(model)
    if not plan:
        raise ValueError(f"tensor parallel has no plan for {type(model).__name__}; set tensor_parallel.plan "
                         "(module path → colwise/rowwise, e.g. {'layers.*.attn.q': 'colwise'})")
    _check_heads(model, size)
    modules = dict(model.named_modules())
    resolved: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"tensor parallel style {style!r} for {pattern!r} is not supported; use colwise "
                             "or rowwise in tensor_parallel.plan")
        regex = _pattern(pattern)
        matched = [name for name in modules if regex.match(name)]
        if not matched:
            raise ValueError(f"tensor_parallel.plan pattern {pattern!r} matches no module of "
                             f"{type(model).__name__}")
        for name in matched:
            linear = modules[name]
            if not isinstance(linear, nn.Linear):
                raise ValueError(f"tensor parallel shards nn.Linear layers; {name!r} is a {type(linear).__name__}")
            features = linear.out_features if style == "colwise" else linear.in_features
            if features % size:
                raise ValueError(f"{name!r} has {features} {'output' if style == 'colwise' else 'input'} "
                                 f"features, not divisible by tensor parallel size {size}")
            resolved[name] = style
    return resolved


def _check_heads(model: nn.Module, size: int) -> None:
    declared = _declared(model, "tensor_parallel_heads")
    if declared is not None:
        heads = dict(cast(Mapping[str, int], declared))
    else:
        hf_config: Any = getattr(model, "config", None)
        heads = {k: getattr(hf_config, k) for k in ("num_attention_heads", "num_key_value_heads")
                 if isinstance(getattr(hf_config, k, None), int)}
    bad = {k: v for k, v in heads.items() if v % size}
    if bad:
        shown = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise ValueError(f"{shown} not divisible by tensor parallel size {size}; heads are never split, "
                         "so use a size that divides the head counts")


def fused_qkv(model: nn.Module, plan: dict[str, str]) -> list[str]:
    """Module paths in the plan of the layers the model declares as fused ``[Q; K; V]``
    (its ``tensor_parallel_fused_qkv()``)."""
    declared = _declared(model, "tensor_parallel_fused_qkv")
    patterns = [_pattern(p) for p in cast(Sequence[str], declared or ())]
    return [name for name in plan if any(p.match(name) for p in patterns)]


def _interleave(tensor: torch.Tensor, size: int, inverse: bool) -> torch.Tensor:
    # [Q; K; V] (3, size, rows) ↔ per-rank [Q_r; K_r; V_r] (size, 3, rows).
    shape = tensor.shape
    if inverse:
        return tensor.reshape(size, 3, -1, *shape[1:]).transpose(0, 1).reshape(shape)
    return tensor.reshape(3, size, -1, *shape[1:]).transpose(0, 1).reshape(shape)


def qkv_to_user(tensor: torch.Tensor, size: int) -> torch.Tensor:
    """A gathered fused-qkv weight/bias back in the model's ``[Q; K; V]`` row order."""
    return _interleave(tensor, size, inverse=True)


def qkv_from_user(tensor: torch.Tensor, size: int) -> torch.Tensor:
    """A ``[Q; K; V]`` weight/bias in the per-rank interleaved order the shards use."""
    return _interleave(tensor, size, inverse=False)


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh | None, plan: dict[str, str]) -> list[str]:
    """Shard ``model``'s Linear layers over ``mesh`` as ``plan`` says (a collective).

    Returns:
        State-dict names stored in the interleaved fused-qkv order (see :func:`qkv_to_user`).

    Raises:
        ValueError: no mesh (one process has nothing to shard over).
    """
    if mesh is None:
        raise ValueError("tensor parallel needs the tensor-parallel mesh of several processes")
    size = mesh.size()
    qkv_interleaved = []
    with torch.no_grad():
        for name in fused_qkv(model, plan):
            for pname, param in model.get_submodule(name).named_parameters(recurse=False):
                param.copy_(qkv_from_user(param, size))
                qkv_interleaved.append(f"{name}.{pname}")
    parallelize_module(model, mesh, {name: STYLES[style]() for name, style in plan.items()})
    return qkv_interleaved
