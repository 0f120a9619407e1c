"""ZeRO-3's construction-time API on hybridtrain, with DeepSpeed's partitions.

- ``Init``: every parameter created inside the block is partitioned when the block ends, as
  DeepSpeed's ``zero.Init`` leaves it (:mod:`.partitioning`): an empty ``data``, this rank's part
  in ``ds_tensor``, ``ds_numel``/``ds_shape``/``ds_id``/``ds_status``. (DeepSpeed partitions each
  module's parameters as that module's constructor returns; the model's own constructor code
  runs on whole parameters either way. Under a config with ``bf16``/``fp16`` enabled floating
  partitions are cast to that dtype, as DeepSpeed's; else they keep their dtype.) ``Init(module=m)``
  partitions an existing ``m``. ``deepspeed.initialize`` puts the partitions straight into the
  engine's shards under ZeRO-3's bf16/fp16 math on several processes
  (:func:`~hybridtrain.deepspeed.runtime.zero.stage3_masters.set_aside_partitions`), else gathers the
  model whole (in its build dtype) and shards it its own way: training from it is training from
  the whole model.
- ``GatheredParameters``: partitioned parameters are gathered whole inside the block (a
  collective); on exit the ``modifier_rank``'s values are broadcast and partitioned again, or,
  without a modifier, the gathered copies are dropped (in-block changes discarded, as in
  DeepSpeed). Around parameters that are whole it lets the code read and write them, with the
  modifier's values broadcast on exit. Around parameters an engine has sharded (ZeRO-3 after
  ``initialize``) it refuses in one line.
- ``register_external_parameter`` needs nothing: a block's parameters are gathered together with
  the module that uses them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybridtrain.deepspeed.runtime.zero import partitioning

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
    """``with deepspeed.zero.Init(...)``: the parameters created in the block are partitioned
    over the data-parallel ranks when it ends (see the module). Accepts DeepSpeed's arguments;
    ``enabled=False`` builds the model whole. A nested ``Init`` leaves the work to the outer one."""

    _depth = 0

    def __init__(self, module: nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: Any = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu: Any = None, **kwargs: Any) -> None:
        self.enabled = enabled
        self.dtype = dtype if dtype is not None else half_dtype(config_dict_or_path if config is None else config)
        self._created: list[tuple[nn.Module, str, nn.Parameter]] = []
        self._register: Any = None
        if enabled:
            _join_launched_group()
        if module is not None and enabled:
            for param in module.parameters():
                if not partitioning.is_partitioned(param):
                    partitioning.partition(param, self.dtype)

    def __enter__(self) -> Init:
        if not self.enabled or Init._depth > 0:
            Init._depth += 1
            return self
        Init._depth += 1
        created = self._created
        register = self._register = nn.Module.register_parameter

        def recording(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            register(module, name, param)
            if param is not None:
                created.append((module, name, param))

        nn.Module.register_parameter = recording  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        Init._depth -= 1
        if self._register is None:
            return
        nn.Module.register_parameter = self._register  # type: ignore[method-assign]
        self._register = None
        if exc[0] is not None:
            return
        seen: set[int] = set()
        for module, name, param in self._created:
            # Only what the model still holds (a parameter replaced during construction is gone).
            if dict(module.named_parameters(recurse=False)).get(name) is param and id(param) not in seen:
                seen.add(id(param))
                if not partitioning.is_partitioned(param):
                    partitioning.partition(param, self.dtype)
        self._created.clear()


def half_dtype(config: Any) -> torch.dtype | None:
    """The half dtype DeepSpeed's ``zero.Init`` casts floating parameters to for ``config`` (a
    DeepSpeed config dict or a path to its JSON): ``bf16``/``fp16`` enabled (``true``, not
    ``"auto"``), else None (they keep their dtype: with no config DeepSpeed would pick one by the
    accelerator, which the drop-in does not)."""
    if isinstance(config, str | os.PathLike):
        with open(config) as file:
            config = json.load(file)
    if not isinstance(config, Mapping):
        return None
    enabled = {key: isinstance(config.get(key), Mapping) and config[key].get("enabled") is True
               for key in ("bf16", "bfloat16", "fp16")}
    if enabled["bf16"] or enabled["bfloat16"]:
        return torch.bfloat16
    return torch.float16 if enabled["fp16"] else None


def _join_launched_group() -> None:
    """Join the process group a launcher describes (one process too: ``deepspeed script.py``,
    ``python -m hybridtrain.deepspeed``, or the variables a notebook sets by hand), as
    DeepSpeed's ``Init`` does before it partitions; code that reads the rank next, such as
    transformers' ``from_pretrained``, needs the group. Without a launcher's variables it
    partitions over this process alone and leaves the process group as it is."""
    from hybridtrain.deepspeed.comm import init_distributed, launched

    if not (dist.is_available() and dist.is_initialized()) and launched():
        init_distributed()


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
    partitioned: list[nn.Parameter] = [
        p for p in tensors if isinstance(p, nn.Parameter) and partitioning.is_partitioned(p)
        and getattr(p, "ds_status", None) is partitioning.ZeroParamStatus.NOT_AVAILABLE]
    partitioning.gather(partitioned)
    try:
        yield
    finally:
        if modifier_rank is not None and dist.is_available() and dist.is_initialized() and \
                dist.get_world_size() > 1:
            with torch.no_grad():
                for tensor in tensors:
                    dist.broadcast(tensor.data, src=modifier_rank)
        for param in partitioned:
            if modifier_rank is not None:
                partitioning.partition(param)  # the modifier's values, cut again
            else:
                partitioning.release(param)


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
