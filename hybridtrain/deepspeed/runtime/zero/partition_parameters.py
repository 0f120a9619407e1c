"""ZeRO-3's construction-time API on hybridtrain.

In DeepSpeed, ``zero.Init`` partitions each parameter as it is created, and
``GatheredParameters`` gathers them back for code that reads or writes whole tensors.
hybridtrain shards a model when the engine is built (``deepspeed.initialize``), not while
it is constructed, so:

- ``Init`` is a context in which the model is built whole (on the CPU unless the code says
  otherwise) and sharded at ``initialize``; the result is the same model.
- ``GatheredParameters`` around parameters that are whole (not yet sharded, or ZeRO-1/2)
  lets the code read and write them; with ``modifier_rank`` set and several processes,
  the modifier's values are broadcast to the others on exit, as DeepSpeed does. Around
  parameters an engine has sharded (ZeRO-3 after ``initialize``) it refuses in one line.
- ``register_external_parameter`` needs nothing: a block's parameters are gathered
  together with the module that uses them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["GatheredParameters", "Init", "register_external_parameter", "unregister_external_parameter",
           "zero_wrapper_for_fp_tensor_constructor"]

_orig_torch_arange = torch.arange
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full


def zero_wrapper_for_fp_tensor_constructor(fn: Any, target_fp_dtype: torch.dtype,
                                           target_device: Any = None) -> Any:
    """DeepSpeed's constructor wrapper (floating tensors made in ``target_fp_dtype`` on
    ``target_device``); kept for code that wraps or replaces it. :class:`Init` does not install it."""

    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return wrapped


class Init:
    """``with deepspeed.zero.Init(...)``: build the model whole; ``deepspeed.initialize``
    shards it (ZeRO-3) as the config asks. Accepts DeepSpeed's arguments; ``enabled=False``
    and every other value behave the same here. ``Init(module=m)`` leaves ``m`` as it is."""

    def __init__(self, module: nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: Any = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu: Any = None, **kwargs: Any) -> None:
        self.enabled = enabled
        self.dtype = dtype

    def __enter__(self) -> Init:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _sharded(param: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor) or isinstance(getattr(param, "data", None), DTensor)


@contextmanager
def _gathered(params: Iterable[torch.Tensor] | torch.Tensor | None, modifier_rank: int | None,
              enabled: bool) -> Iterator[None]:
    if params is None or not enabled:
        yield
        return
    tensors = [params] if torch.is_tensor(params) else [p for p in params if p is not None]
    if any(_sharded(p) for p in tensors):
        raise NotImplementedError("deepspeed.zero.GatheredParameters around parameters an engine has sharded "
                                  "(ZeRO-3 after deepspeed.initialize) is not supported by hybridtrain.deepspeed; "
                                  "read engine.module_state_dict() or save with engine.save_16bit_model()")
    yield
    if modifier_rank is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        with torch.no_grad():
            for tensor in tensors:
                dist.broadcast(tensor.data, src=modifier_rank)


class GatheredParameters:
    """``with deepspeed.zero.GatheredParameters(params, modifier_rank=None)``: whole
    parameters inside the block; the ``modifier_rank``'s changes reach every rank on exit.

    Args:
        params: a parameter, several, or None (nothing to do).
        modifier_rank: the rank whose in-block changes are kept (None: read only).
        fwd_module: accepted for DeepSpeed's signature (external-parameter bookkeeping).
        enabled: False makes the block do nothing, as in DeepSpeed.
    """

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None,
                 enabled: bool = True) -> None:
        self._context = _gathered(params, modifier_rank, enabled)

    def __enter__(self) -> None:
        self._context.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._context.__exit__(*exc)


def register_external_parameter(module: nn.Module, parameter: torch.nn.Parameter) -> None:
    """DeepSpeed gathers ``parameter`` with ``module`` from then on; here nothing is needed."""


def unregister_external_parameter(module: nn.Module, parameter: torch.nn.Parameter) -> None:
    """The inverse of :func:`register_external_parameter`; nothing to undo."""
