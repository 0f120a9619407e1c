"""Activation checkpointing: a checkpointed module keeps only its inputs during forward
and recomputes its activations in backward.

The module's ``forward`` is wrapped in place (:mod:`~hybridtrain.runtime.forward_wrap`), so
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

from hybridtrain.runtime.forward_wrap import unwrap_forward, wrap_forward

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


def _checkpointed_forward(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    # Without grad (eval) there is nothing to save, so recomputation would be pure waste.
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
