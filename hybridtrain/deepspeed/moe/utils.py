"""``deepspeed.moe.utils`` for scripts written for DeepSpeed. hybridtrain has no expert
(MoE) layers, so a model's parameter groups have no expert parameters to split out."""

from __future__ import annotations

from typing import Any


def is_moe_param(param: Any) -> bool:
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, max_group_size: Any = None) -> list[
        dict[str, Any]]:
    """DeepSpeed's helper: the groups with expert parameters split out. Without expert
    parameters (always, here) the groups come back as a list, unchanged.

    Raises:
        NotImplementedError: a parameter is marked as an expert's (``allreduce = False``).
    """
    groups = [param_groups] if isinstance(param_groups, dict) else list(param_groups)
    for group in groups:
        if any(is_moe_param(p) for p in group["params"]):
            raise NotImplementedError("mixture-of-experts parameters are not supported by hybridtrain")
    return groups
