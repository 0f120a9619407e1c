"""Activation checkpointing: a checkpointed module keeps only its inputs during forward
and recomputes its activations in backward.

The module's ``forward`` is wrapped in place (:mod:`~hybridtrain.runtime.activations.forward_wrap`), so
parameter names (and therefore state dicts and Hugging Face weights) stay unchanged.
The RNG state is saved and restored around the recomputation, so dropout draws the same
masks as the un-checkpointed run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hybridtrain.compat import inside_backward, tree_flatten, tree_unflatten
from hybridtrain.runtime import stream_marks
from hybridtrain.runtime.activations.forward_wrap import unwrap_forward, wrap_forward

_ORIGINAL_FORWARD = "_hybridtrain_original_forward"


def select_checkpoint_targets(model: nn.Module, blocks: Sequence[nn.Module] | None,
                              every_n_blocks: int = 1,
                              module_classes: Sequence[str] = ()) -> list[nn.Module]:
    """Modules to checkpoint: those of the named classes, else every n-th block.

    Raises:
        ValueError: no module of the named classes exists, or there are no blocks.
    """
    if module_classes:
        wanted = set(module_classes)
        targets = [m for m in model.modules() if type(m).__name__ in wanted]
        if not targets:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise ValueError(
                f"activation_checkpointing.module_classes = {sorted(wanted)} matches no module; "
                f"classes in this model: {', '.join(present[:20])}"
            )
        return targets
    if not blocks:
        raise ValueError("activation_checkpointing needs the model's blocks; set model.blocks")
    return [b for i, b in enumerate(blocks) if i % every_n_blocks == 0]


def apply_activation_checkpointing(modules: Sequence[nn.Module]) -> None:
    """Make each module's forward checkpointed (idempotent)."""
    for module in modules:
        wrap_forward(module, _ORIGINAL_FORWARD, _checkpointed_forward)


def remove_activation_checkpointing(modules: Sequence[nn.Module]) -> None:
    """Undo :func:`apply_activation_checkpointing`."""
    for module in modules:
        unwrap_forward(module, _ORIGINAL_FORWARD)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`apply_activation_checkpointing` wrapped this module."""
    return hasattr(module, _ORIGINAL_FORWARD)


_CACHE_KWARGS = ("cache", "layer_past")
"""Keyword arguments through which Hugging Face layers receive a key/value cache they write."""


def is_kv_cache(value: object) -> bool:
    """A Hugging Face ``Cache`` (``DynamicCache`` …), recognised by its interface."""
    return type(value).__name__.endswith("Cache") and callable(getattr(value, "update", None))


def without_kv_cache(module: object, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` for a forward of ``module`` that will run again in backward: no key/value
    cache for it to write.

    A layer appends its keys and values to a cache it is handed (XLM hands one to every
    attention layer whatever ``use_cache`` says), so the recomputation would append them a
    second time and attend over twice the sequence. Hugging Face's gradient checkpointing
    (``GradientCheckpointingLayer``) has the rule this follows: ``use_cache`` off, and the
    ``cache`` / ``layer_past`` arguments dropped unless the layer only reads its cache
    (``_can_checkpoint_with_cache``); ``past_key_values`` (a prefix, say) is kept.
    """
    out = dict(kwargs)
    if out.get("use_cache"):
        out["use_cache"] = False
    if not getattr(module, "_can_checkpoint_with_cache", False):
        for name in _CACHE_KWARGS:
            if is_kv_cache(out.get(name)):
                out[name] = None
    return out


def _checkpointed_forward(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    # Without grad (eval) there is nothing to save, so recomputation would be pure waste.
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    kwargs = without_kv_cache(getattr(forward, "__self__", None), kwargs)
    return checkpoint(_marked_in_backward(forward), *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def _marked_in_backward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward``, its second run (inside backward: the recomputation) marked for a measured
    step timeline (:mod:`hybridtrain.runtime.stream_marks`) on the compute stream."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if not inside_backward():  # the first forward
            return forward(*args, **kwargs)
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        with stream_marks.mark_compute("recomputation", device):
            return forward(*args, **kwargs)

    return run


def tensor_call(forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                leave_out: Callable[[object], bool] = lambda _value: False,
                ) -> tuple[list[torch.Tensor], Callable[..., tuple[torch.Tensor, ...]],
                           Callable[[Sequence[torch.Tensor]], Any]]:
    """``forward(*args, **kwargs)`` as a function of its tensor arguments only, the shape a
    custom checkpoint ``torch.autograd.Function`` takes (tensors in, tensors out).

    Neither returned closure holds a tensor: a checkpoint keeps ``run`` until its backward,
    so holding the inputs there would keep them in device memory after they were swapped
    to the host (or their block's backward ran), and holding the outputs would keep the
    recomputed ones alive.

    Args:
        forward: the function to call.
        args, kwargs: its arguments.
        leave_out: other arguments not to keep either; ``run`` passes ``None`` for them.

    Returns:
        ``(inputs, run, rebuild)``: the tensor arguments in order; ``run(*tensors)`` calls
        ``forward`` with them and returns the tensors of its output; ``rebuild(tensors)``
        puts such tensors back into the output's structure (once ``run`` has run).
    """
    flat, spec = tree_flatten((args, kwargs))
    slots = [i for i, leaf in enumerate(flat) if isinstance(leaf, torch.Tensor)]
    inputs = [flat[i] for i in slots]
    kept = [None if isinstance(leaf, torch.Tensor) or leave_out(leaf) else leaf for leaf in flat]
    out_structure: list[Any] = []  # [spec, non-tensor leaves (None for tensors), is-tensor flags]

    def run(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        filled = list(kept)
        for i, t in zip(slots, tensors, strict=True):
            filled[i] = t
        a, kw = tree_unflatten(filled, spec)
        out_leaves, o_spec = tree_flatten(forward(*a, **kw))
        is_tensor = [isinstance(x, torch.Tensor) for x in out_leaves]
        out_structure[:] = [o_spec, [None if t else x for x, t in zip(out_leaves, is_tensor, strict=True)], is_tensor]
        return tuple(x for x, t in zip(out_leaves, is_tensor, strict=True) if t)

    def rebuild(tensors: Sequence[torch.Tensor]) -> Any:
        o_spec, o_leaves, is_tensor = out_structure
        it = iter(tensors)
        return tree_unflatten([next(it) if t else x for x, t in zip(o_leaves, is_tensor, strict=True)], o_spec)
    return inputs, run, rebuild
