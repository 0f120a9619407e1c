"""Every private API hybridtrain uses, each behind one name here with the reason no public
one serves. Nothing else in the package imports an underscored module or name of torch,
optuna, prometheus_client or argparse (``tests/test_compat.py`` checks the package's source).

Checked on torch 2.13.0 (CI) and Python 3.11. torch 2.11 is not verified: the names
below are those of torch 2.13's source; each has been in torch since before 2.6 (the
oldest torch ``pyproject.toml`` allows), but no run on 2.11 confirmed it.

==============================================  ==============================================
name here                                       why no public API serves
==============================================  ==============================================
``tree_flatten``, ``tree_unflatten``,           torch's pytree (``torch.utils._pytree``): the
``tree_leaves``, ``tree_map``, ``tree_map_only``  one that knows torch's containers and the ones
                                                Hugging Face registers (``ModelOutput``); torch
                                                2.13 has no public ``torch.utils.pytree``
``TorchDispatchMode``                           the documented way to see every aten op
                                                ("Extending all of torch API with modes");
                                                its module is underscored, the class is what
                                                ``FlopCounterMode`` itself builds on
``is_traceable_wrapper_subclass``               the test the dispatch mode's own users make for
                                                a wrapper tensor (DTensor) that owns no memory
                                                of its own; same underscored module, no public
                                                name
``unscale_and_check_``                          ``torch._amp_foreach_non_finite_check_and_unscale_``:
                                                GradScaler's own fused unscale + inf/nan check,
                                                one kernel per device for every gradient
``cpu_flash_attention``, ``ATTENTION_OP_NAMES``  aten's fused attention ops: the planner
                                                emulates the CPU kernel on the meta device and
                                                counts their FLOPs (``FlopCounterMode`` keys its
                                                formulas by these ops too)
``optuna_rdb_models``                           Optuna's SQLAlchemy tables: one query for every
                                                finished trial at each scrape (``get_trials``
                                                loads every parameter and value of every trial)
``prometheus_float``                            ``prometheus_client.utils.floatToGoString``: the
                                                ``le`` labels its own histograms write, so ours
                                                read the same
``inside_backward``                             ``torch._C._current_graph_task_id``: whether
                                                autograd's engine is running a backward on this
                                                thread (a checkpointed forward's second run is
                                                its recomputation); no public query exists
``dcp_storage_info``                            DCP's ``_StorageInfo``: the one type a sharded
                                                checkpoint's ``.metadata`` stores a file's
                                                relative path in, which the safe loader checks
``take_dash_digit_words_as_values``             argparse's ``_negative_number_matcher`` (Python
                                                3.11; 3.12-3.14 keep it): argparse has no
                                                public way to take ``-5GB`` after an option as
                                                its value (CPython issues 105712, 123945)
==============================================  ==============================================

torch's names are imported on first use (``import hybridtrain.compat`` pulls in no torch):
the command-line parser and the HPO server import this module without paying for torch.
"""

from __future__ import annotations

import argparse
import importlib
import re
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
    from torch.utils._pytree import (
        tree_flatten,
        tree_leaves,
        tree_map,
        tree_map_only,
        tree_unflatten,
    )

_LAZY = {
    "tree_flatten": "torch.utils._pytree",
    "tree_unflatten": "torch.utils._pytree",
    "tree_leaves": "torch.utils._pytree",
    "tree_map": "torch.utils._pytree",
    "tree_map_only": "torch.utils._pytree",
    "TorchDispatchMode": "torch.utils._python_dispatch",
    "is_traceable_wrapper_subclass": "torch.utils._python_dispatch",
}

ATTENTION_OP_NAMES = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                      "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
"""aten's fused attention kernels (forward), which ``scaled_dot_product_attention`` dispatches to."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridtrain.compat' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def inside_backward() -> bool:
    """Whether autograd is running a backward on this thread."""
    import torch

    return bool(torch._C._current_graph_task_id() != -1)


def dcp_storage_info() -> type[_StorageInfo]:
    """``torch.distributed.checkpoint.filesystem._StorageInfo``."""
    found: type[_StorageInfo] = importlib.import_module("torch.distributed.checkpoint.filesystem")._StorageInfo
    return found


def take_dash_digit_words_as_values(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` read a word that starts with ``-`` and a digit (``-5GB``, ``-1e-3``)
    as a value, as it reads ``-5``: valid where no option of its is named ``-<digit>``."""
    parser._negative_number_matcher = re.compile(r"^-\.?\d")


def unscale_and_check_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiply every gradient of ``grads`` (one device, one dtype) by ``inv_scale`` in place
    and set ``found_inf`` to 1 when any is inf or nan (GradScaler's kernel)."""
    import torch

    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def cpu_flash_attention() -> tuple[Any, Any]:
    """aten's CPU flash-attention forward and backward ops."""
    import torch

    return (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)


def optuna_rdb_models() -> ModuleType:
    """``optuna.storages._rdb.models`` (Optuna's tables: ``TrialModel``, ``StudyModel`` …)."""
    return importlib.import_module("optuna.storages._rdb.models")


def prometheus_float(value: float) -> str:
    """``value`` as Prometheus' client writes a float label (``1.0``, ``+Inf``)."""
    from prometheus_client.utils import floatToGoString

    result: str = floatToGoString(value)
    return result


__all__ = ["ATTENTION_OP_NAMES", "TorchDispatchMode", "cpu_flash_attention", "is_traceable_wrapper_subclass",
           "optuna_rdb_models",
           "prometheus_float", "take_dash_digit_words_as_values", "tree_flatten", "tree_leaves", "tree_map",
           "tree_map_only", "tree_unflatten",
           "unscale_and_check_"]
