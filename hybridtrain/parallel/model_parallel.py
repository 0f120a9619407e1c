"""Naive model parallel (``device_map``): the source document's first example — put
different modules on different devices inside one process and move activations between
them. Only one device works at a time (the others idle), which is what pipelining fixes;
but it needs no second process and fits a model whose blocks fit the devices together.

Each mapped module gets a forward pre-hook that moves its inputs to its device, and a
forward hook that moves its outputs back to the main device, so unmapped code around it
(embeddings, norm, head, the loss) never sees a foreign device. Autograd moves the
gradients back the same way. With every entry on the main device the math is unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hybridtrain.runtime import transfer
from hybridtrain.runtime.device import normalize_device


def _move(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        if value.device == device:
            return value
        if (value.device.type == "cpu") != (device.type == "cpu"):
            transfer.count_bytes("device_map", value.numel() * value.element_size())
        # A copy to the host must have landed before the host reads it: only copies to a
        # device are stream-ordered (a non-blocking device→host copy returns at once and
        # the CPU module would read memory still being written).
        return value.to(device, non_blocking=device.type != "cpu")
    if isinstance(value, Mapping):
        return type(value)({k: _move(v, device) for k, v in value.items()})  # type: ignore[call-arg]
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_move(v, device) for v in value))
    if isinstance(value, list | tuple):
        return type(value)(_move(v, device) for v in value)
    return value


def resolve_device_map(model: nn.Module, device_map: Mapping[str, str]) -> dict[str, torch.device]:
    """Check a device map against the model; returns path → ``torch.device``.

    Raises:
        ValueError: unknown module path (with candidates), a device that is not one or is
            not available, or nested entries (a module inside another mapped module).
    """
    resolved: dict[str, torch.device] = {}
    names = dict(model.named_modules())
    for path, spec in device_map.items():
        if path not in names or not path:
            close = [n for n in names if n and n.split(".")[0] == path.split(".")[0]][:5]
            raise ValueError(f"device_map key {path!r} is not a module of {type(model).__name__}; "
                             f"module paths look like: {', '.join(close) or ', '.join(list(names)[1:6])}")
        try:
            device = torch.device(spec)
        except RuntimeError:
            raise ValueError(f"device_map[{path!r}] = {spec!r} is not a device; use cpu, cuda or cuda:N") from None
        if device.type == "cuda" and (not torch.cuda.is_available()
                                      or (device.index or 0) >= torch.cuda.device_count()):
            raise ValueError(f"device_map[{path!r}] = {spec!r} but this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s); use cpu or an existing cuda:N")
        resolved[path] = normalize_device(device)
    for path in resolved:
        outer = [o for o in resolved if o != path and path.startswith(o + ".")]
        if outer:
            raise ValueError(f"device_map key {path!r} lies inside {outer[0]!r}; map either the module or its parts")
    return resolved


def apply_device_map(model: nn.Module, device_map: Mapping[str, torch.device],
                     main_device: torch.device) -> list[RemovableHandle]:
    """Move each mapped module to its device and hook activation transfers around it.

    Args:
        model: the model, already on ``main_device``.
        device_map: from :func:`resolve_device_map`.
        main_device: where unmapped modules, inputs and the loss live.

    Returns:
        The hook handles (``handle.remove()`` undoes the transfers, not the placement).
    """
    handles: list[RemovableHandle] = []
    main_device = normalize_device(main_device)
    for path, device in device_map.items():
        device = normalize_device(device)
        module = model.get_submodule(path)
        module.to(device)

        def to_module(_: nn.Module, args: Any, kwargs: Any, device: torch.device = device) -> Any:
            return _move(args, device), _move(kwargs, device)

        def to_main(_: nn.Module, __: Any, output: Any) -> Any:
            return _move(output, main_device)

        handles.append(module.register_forward_pre_hook(to_module, with_kwargs=True))
        handles.append(module.register_forward_hook(to_main))
    return handles
