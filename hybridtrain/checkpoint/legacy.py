"""Reading format-1 checkpoints (hybridtrain before sharded checkpoints).

Format 1 is ``model.pt`` (the full model state dict), ``engine.pt`` (optimizer,
scheduler, scaler, counters, RNG, client state; the optimizer state keyed by index, or by
parameter name under ZeRO) and ``meta.json`` with a SHA-256 per file. It is still read, so
runs saved by an older version resume; it loads only onto the layout that saved it, as
before (same world size for the optimizer state), and the next save writes format 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hybridtrain.checkpoint.layout import (
    IncompleteCheckpointError,
    plain_file_problem,
    verify_files,
)


def read(path: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """The files of the format-1 checkpoint at ``path``, verified against ``meta``.

    Raises:
        IncompleteCheckpointError: a file missing, or whose checksum does not match.
    """
    for name in meta["files"]:
        problem = plain_file_problem(path, name)
        if problem:
            raise IncompleteCheckpointError(f"checkpoint file {path / name} {problem}")
    problem = verify_files(path, meta["files"], {"files": {k: [0, v] for k, v in meta["files"].items()}})
    if problem:
        raise IncompleteCheckpointError(f"checkpoint file {problem}")
    return {name: torch.load(path / name, map_location="cpu", weights_only=True) for name in meta["files"]}
