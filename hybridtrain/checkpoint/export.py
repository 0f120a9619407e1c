"""One consolidated model from a (sharded) checkpoint: ``hybridtrain checkpoint export``.

Runs in one process whatever world size saved the checkpoint: every model entry is read
whole (DCP assembles it from the ranks' shards). What is written:

- a Hugging Face model (the run's config names ``model.name: hf:<type>``): the model is
  rebuilt from the run's config, loaded, and written with ``save_pretrained`` (safetensors
  and ``config.json``, loadable with ``AutoModelForCausalLM.from_pretrained``);
- anything else: ``model.safetensors`` with every state-dict entry under its name, plus
  ``hybridtrain_config.json`` (the run's config) when the run's config is known.

The run's config is ``config.json`` of the run directory (``<output_dir>/checkpoints/
step-N`` → ``<output_dir>/config.json``), or the file given with ``--config``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from hybridtrain.checkpoint import legacy, sharded
from hybridtrain.checkpoint.layout import CheckpointError, read_meta
from hybridtrain.checkpoint.training_state import MODEL, saved_names
from hybridtrain.outputs import check_new_dir, check_not_an_input
from hybridtrain.parallel.tensor import qkv_to_user


def model_state(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The full model state dict of the checkpoint ``path`` (CPU tensors) and its meta.

    Raises:
        CheckpointError: missing, incomplete or corrupt.
    """
    found, meta = read_meta(path)
    if meta["format"] == 1:
        return legacy.read(found, meta)["model.pt"], meta
    sharded.verify(found, meta)
    stored = sharded.storage_metadata(found)
    state: dict[str, Any] = {key[len(MODEL):]: torch.empty(md.size, dtype=md.properties.dtype)
                             for key, md in stored.state_dict_metadata.items()
                             if key.startswith(MODEL) and isinstance(md, TensorStorageMetadata)}
    sharded.load(found, {MODEL + name: tensor for name, tensor in state.items()})
    for name, size in saved_names(found, stored).interleave.items():
        if name in state:  # saved in tensor parallel's row order: back to [Q; K; V]
            state[name] = qkv_to_user(state[name], size)
    return state, meta


def run_config(path: Path, config: str | Path | None) -> dict[str, Any] | None:
    """The run's config as a dict: ``config`` if given, else the run directory's ``config.json``."""
    candidate = Path(config) if config else path.resolve().parent.parent / "config.json"
    if not candidate.is_file():
        if config:
            raise CheckpointError(f"--config {config} does not exist")
        return None
    try:
        loaded: dict[str, Any] = json.loads(candidate.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{candidate} is not a JSON config ({exc})") from None
    return loaded


def export(path: str | Path, out: str | Path, config: str | Path | None = None, overwrite: bool = False) -> Path:
    """Write the model of checkpoint ``path`` to the directory ``out`` (see the module docstring).

    Args:
        path: the checkpoint directory.
        out: the export directory: new or empty, unless ``overwrite``.
        config: the run's config (default: the run directory's ``config.json``).
        overwrite: replace what ``out`` holds.

    Returns:
        The main file written.

    Raises:
        CheckpointError: the checkpoint or config cannot be read.
        ValueError: ``out`` is a file, holds files (without ``overwrite``), or is or holds
            the checkpoint or config read.
    """
    path, out = Path(path), Path(out)
    check_not_an_input(out, [path, *([config] if config else [])], "export target", nothing_inside=True)
    check_new_dir(out, "export target", overwrite)
    state, meta = model_state(path)
    cfg = run_config(path, config)
    model_cfg: dict[str, Any] = (cfg or {}).get("model", {})
    out.mkdir(parents=True, exist_ok=True)
    if str(model_cfg.get("name", "")).startswith("hf:"):
        return _save_pretrained(state, model_cfg, cfg or {}, out)
    from safetensors.torch import save_file

    target = out / "model.safetensors"
    # safetensors refuses tensors that share memory; each entry here was read on its own.
    save_file({k: v.contiguous() for k, v in state.items()}, str(target),
              metadata={"format": "pt", "step": str(meta.get("step", ""))})
    target.chmod(0o644)  # safetensors creates it owner-only; an exported model is meant to be shared
    if cfg is not None:
        (out / "hybridtrain_config.json").write_text(json.dumps(cfg, indent=1))
    return target


def _save_pretrained(state: dict[str, torch.Tensor], model_cfg: dict[str, Any], cfg: dict[str, Any],
                     out: Path) -> Path:
    from hybridtrain.models.factory import build_model

    name, overrides = str(model_cfg["name"]), dict(model_cfg.get("overrides", {}))
    seq_len = int(cfg.get("data", {}).get("seq_len", 128))
    with torch.device("meta"):
        probe: Any = build_model(name, overrides, 256, seq_len, 0)
    # The vocabulary was sized from the data: read it back from the embedding's rows.
    embedding = next(n for n, p in probe.named_parameters() if p is probe.get_input_embeddings().weight)
    vocab = int(state[embedding].shape[0])
    model: Any = build_model(name, overrides, vocab, seq_len, int(cfg.get("seed", 0)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"the checkpoint does not fit {name} built from the run's config: "
                              f"missing {list(missing)[:3]}, unexpected {list(unexpected)[:3]}")
    model.save_pretrained(str(out), safe_serialization=True)
    return out / "model.safetensors"
