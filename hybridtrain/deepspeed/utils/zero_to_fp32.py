"""``deepspeed.utils.zero_to_fp32``: the whole fp32 model out of a checkpoint that
``engine.save_checkpoint`` wrote (any ZeRO stage, any number of ranks), as DeepSpeed's
script recovers it, and what Lightning's ``convert_zero_checkpoint_to_fp32_state_dict`` calls.

``checkpoint_dir`` is the ``save_dir`` given to ``save_checkpoint``; the tag is read from its
``latest`` file unless given.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybridtrain.checkpoint.export import model_state

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint"]


def _tagged(checkpoint_dir: str | os.PathLike[str], tag: str | None) -> Path:
    root = Path(checkpoint_dir)
    if tag is None:
        latest = root / "latest"
        if not latest.is_file():
            raise ValueError(f"Unable to find 'latest' file at {latest}")
        tag = latest.read_text().strip()
    return root / str(tag)


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike[str], tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The model's whole state dict in fp32 (CPU tensors).

    Raises:
        ValueError: no ``latest`` file and no tag; CheckpointError: missing or incomplete.
    """
    state, _ = model_state(_tagged(checkpoint_dir, tag))
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike[str],
                                               output_dir: str | os.PathLike[str], tag: str | None = None,
                                               exclude_frozen_parameters: bool = False, **_: Any) -> None:
    """Write the fp32 state dict to ``output_dir`` (a file path, or a directory that gets
    ``pytorch_model.bin``), with ``torch.save``."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    out = Path(output_dir)
    if out.is_dir() or not out.suffix:
        out.mkdir(parents=True, exist_ok=True)
        out = out / "pytorch_model.bin"
    torch.save(state, out)


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str | os.PathLike[str],
                                         tag: str | None = None) -> nn.Module:
    """Load the checkpoint's fp32 weights into ``model`` (on the CPU) and return it."""
    model = model.cpu()
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag), strict=False)
    return model
