"""``deepspeed.utils.zero_to_fp32``: the whole fp32 model out of a checkpoint that
``engine.save_checkpoint`` wrote, with DeepSpeed's functions and command line
(``python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR``; Lightning's
``convert_zero_checkpoint_to_fp32_state_dict`` calls these).

``checkpoint_dir`` is the ``save_dir`` given to ``save_checkpoint``; the tag is read from its
``latest`` file unless given. DeepSpeed's layout (the real DeepSpeed's ZeRO-0/1/2
checkpoints, and the drop-in's) is read by :mod:`hybridtrain.deepspeed.checkpoint.reader`
with a restricted unpickler; a tag holding hybridtrain's own sharded checkpoint is read too.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybridtrain.deepspeed.checkpoint import files, reader

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "convert_zero_checkpoint_to_state_dict",
           "get_checkpoint_files", "get_fp32_state_dict_from_zero_checkpoint", "get_model_state_file",
           "get_model_state_files", "get_optim_files", "load_state_dict_from_zero_checkpoint", "main"]


def _natural_key(text: str) -> list[Any]:
    return [int(c) if c.isdigit() else c for c in re.split(r"(\d+)", text)]


def get_model_state_file(checkpoint_dir: str | os.PathLike[str], zero_stage: int) -> str:
    """The model-states file of tag directory ``checkpoint_dir`` (rank 0's under ZeRO-3).

    Raises:
        FileNotFoundError: no such directory or file.
    """
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"Directory '{checkpoint_dir}' doesn't exist")
    name = files.MODEL_STATES if int(zero_stage) <= 2 else "zero_pp_rank_0_mp_rank_00_model_states.pt"
    path = os.path.join(checkpoint_dir, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"can't find model states file at '{path}'")
    return path


def get_checkpoint_files(checkpoint_dir: str | os.PathLike[str], glob_pattern: str) -> list[str]:
    """The files of ``checkpoint_dir`` matching ``glob_pattern``, in natural order.

    Raises:
        FileNotFoundError: none.
    """
    found = sorted((str(p) for p in Path(checkpoint_dir).glob(glob_pattern)), key=_natural_key)
    if not found:
        raise FileNotFoundError(f"can't find {glob_pattern} files in directory '{checkpoint_dir}'")
    return found


def get_optim_files(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """Every rank's ZeRO optimizer file of tag directory ``checkpoint_dir``."""
    return get_checkpoint_files(checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """Every model-states file of tag directory ``checkpoint_dir``."""
    return get_checkpoint_files(checkpoint_dir, "*_model_states.pt")


def _tag_dir(checkpoint_dir: str | os.PathLike[str], tag: str | None) -> Path:
    found = files.resolve_tag(checkpoint_dir, tag)
    if found is None:
        raise ValueError(f"Unable to find 'latest' file at {Path(checkpoint_dir) / files.LATEST}")
    if not found.is_dir():
        raise FileNotFoundError(f"Directory '{found}' doesn't exist")
    return found


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike[str], tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The model's whole state dict in fp32 (CPU tensors, floating entries in fp32). ``lazy_mode``
    gives the same tensors (they are whole already).

    Raises:
        ValueError: no ``latest`` file and no tag; FileNotFoundError: no such tag;
        UnreadableDeepSpeedFile / CheckpointError: missing, incomplete or not plain data.
    """
    tag_dir = _tag_dir(checkpoint_dir, tag)
    if files.is_deepspeed_layout(tag_dir):
        saved = reader.read(tag_dir, with_optimizer=False)
        state = saved.fp32_state_dict()
        if exclude_frozen_parameters:
            frozen = set(saved.model_states.get("frozen_param_shapes") or ())
            state = {k: v for k, v in state.items() if k not in frozen}
        return state
    from hybridtrain.checkpoint.export import model_state

    native, _ = model_state(tag_dir)
    return {k: v.float() if v.is_floating_point() else v for k, v in native.items()}


def convert_zero_checkpoint_to_state_dict(checkpoint_dir: str | os.PathLike[str], output_dir: str | os.PathLike[str],
                                          dtype: torch.dtype | str = torch.float32, max_shard_size: str | int = "5GB",
                                          safe_serialization: bool = False, tag: str | None = None,
                                          exclude_frozen_parameters: bool = False) -> None:
    """Write the whole state dict (floats in ``dtype``) into directory ``output_dir``:
    ``pytorch_model.bin`` (``model.safetensors`` with ``safe_serialization``), sharded with
    an index file past ``max_shard_size`` (needs ``huggingface_hub``), as DeepSpeed does."""
    target = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    state = {k: v.to(target).contiguous() if v.is_floating_point() else v.contiguous() for k, v in state.items()}
    out = Path(output_dir)
    if out.suffix in (".bin", ".pt", ".safetensors") and not out.is_dir():
        # DeepSpeed before 0.15 took a file path here; Lightning's older helpers still pass one.
        _save(state, out, safe_serialization)
        return
    out.mkdir(parents=True, exist_ok=True)
    weights_name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    shards: dict[str, list[str]] = {weights_name: list(state)}
    index = None
    if max_shard_size is not None:
        from huggingface_hub import split_torch_state_dict_into_shards

        pattern = weights_name.replace(".bin", "{suffix}.bin").replace(".safetensors", "{suffix}.safetensors")
        split = split_torch_state_dict_into_shards(state, filename_pattern=pattern, max_shard_size=max_shard_size)
        shards = split.filename_to_tensors
        if split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    for shard, names in shards.items():
        _save({n: state[n] for n in names}, out / shard, safe_serialization)
    if index is not None:
        import json

        (out / f"{weights_name}.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _save(state: dict[str, torch.Tensor], path: Path, safe_serialization: bool) -> None:
    if safe_serialization:
        from safetensors.torch import save_file

        save_file(state, str(path), metadata={"format": "pt"})
    else:
        torch.save(state, path)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike[str],
                                               output_dir: str | os.PathLike[str], max_shard_size: str | int = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """:func:`convert_zero_checkpoint_to_state_dict` in fp32."""
    convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, torch.float32, max_shard_size,
                                          safe_serialization, tag, exclude_frozen_parameters)


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str | os.PathLike[str],
                                         tag: str | None = None) -> nn.Module:
    """Load the checkpoint's fp32 weights into ``model`` (on the CPU) and return it."""
    model = model.cpu()
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag), strict=False)
    return model


def main(argv: Sequence[str] | None = None) -> int:
    """DeepSpeed's ``zero_to_fp32.py`` command line."""
    parser = argparse.ArgumentParser(description="Recover the whole fp32 model from a ZeRO checkpoint")
    parser.add_argument("checkpoint_dir", help="the checkpoint folder (holding 'latest'), e.g. path/checkpoint-12")
    parser.add_argument("output_dir", help="directory for the fp32 state dict files")
    parser.add_argument("--max_shard_size", default="5GB", help="largest shard, e.g. 5GB")
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors")
    parser.add_argument("-t", "--tag", default=None, help="the tag, e.g. global_step1 (default: 'latest')")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave frozen parameters out")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted, as DeepSpeed's")
    args = parser.parse_args(argv)
    convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir, args.max_shard_size,
                                               args.safe_serialization, args.tag, args.exclude_frozen_parameters)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
