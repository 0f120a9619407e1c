"""``deepspeed.utils.groups``: the data-parallel group queries (hybridtrain's data-parallel
group is the whole world here; model-parallel groups come from its config, not from these)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["_get_data_parallel_group", "_get_data_parallel_rank", "_get_data_parallel_world_size"]


def _get_data_parallel_group() -> Any:
    return dist.group.WORLD


def _get_data_parallel_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _get_data_parallel_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _get_sequence_parallel_group() -> Any:
    raise NotImplementedError("deepspeed.utils.groups: sequence parallel (Ulysses) is not supported by "
                              "hybridtrain.deepspeed")
