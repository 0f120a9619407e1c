"""Wrapping a module's ``forward`` in place (checkpointing, activation swapping).

Replacing the module by a wrapper module would rename its parameters (``block.0.x`` →
``block.0.module.x``) and break state dicts and Hugging Face weight names; setting an
instance attribute ``forward`` changes only what ``module(...)`` runs. The original
forward is kept under a marker attribute, which also makes wrapping idempotent and
reversible.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn


def wrap_forward(module: nn.Module, marker: str, wrapper: Callable[..., Any]) -> bool:
    """Make ``module(...)`` call ``wrapper(original_forward, *args, **kwargs)``.

    Returns:
        False when ``module`` already carries ``marker`` (nothing changed).
    """
    if hasattr(module, marker):
        return False
    original = module.forward
    setattr(module, marker, original)
    module.forward = functools.partial(wrapper, original)
    return True


def unwrap_forward(module: nn.Module, marker: str) -> None:
    """Undo :func:`wrap_forward` (no-op for a module without ``marker``)."""
    if hasattr(module, marker):
        del module.forward
        delattr(module, marker)
