"""Checkpoints: sharded on ``torch.distributed.checkpoint``, committed atomically, resharded
on load, exported as one model.

- :mod:`~hybridtrain.checkpoint.layout`: the directory, its commit marker, completeness,
  cleanup of partial saves;
- :mod:`~hybridtrain.checkpoint.sharded`: every rank writes/reads its own part (DCP), in
  the background if asked;
- :mod:`~hybridtrain.checkpoint.training_state`: the engine's state by parameter name in
  logical shapes, so any world size or layout loads it;
- :mod:`~hybridtrain.checkpoint.resume`: the newest usable checkpoint of a run;
- :mod:`~hybridtrain.checkpoint.legacy`: reading format 1;
- :mod:`~hybridtrain.checkpoint.export`: ``hybridtrain checkpoint export``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Imported on first use: the CLI registers ``hybridtrain checkpoint`` through this package,
# and ``hybridtrain --help`` must not pay for importing torch.
_EXPORTS = {
    **dict.fromkeys(["FORMAT_VERSION", "CheckpointError", "IncompleteCheckpointError", "complete_checkpoints",
                     "prune", "read_meta", "remove_partial"], "hybridtrain.checkpoint.layout"),
    **dict.fromkeys(["latest_complete", "resume_newest"], "hybridtrain.checkpoint.resume"),
    "wait_for_pending": "hybridtrain.checkpoint.sharded",
    **dict.fromkeys(["LAYOUT_SETTINGS", "Restored", "TrainingParts", "load", "save"],
                    "hybridtrain.checkpoint.training_state"),
}

if TYPE_CHECKING:
    from hybridtrain.checkpoint.layout import (
        FORMAT_VERSION,
        CheckpointError,
        IncompleteCheckpointError,
        complete_checkpoints,
        prune,
        read_meta,
        remove_partial,
    )
    from hybridtrain.checkpoint.resume import latest_complete, resume_newest
    from hybridtrain.checkpoint.sharded import wait_for_pending
    from hybridtrain.checkpoint.training_state import (
        LAYOUT_SETTINGS,
        Restored,
        TrainingParts,
        load,
        save,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridtrain.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "FORMAT_VERSION", "LAYOUT_SETTINGS", "CheckpointError", "IncompleteCheckpointError", "Restored",
    "TrainingParts", "complete_checkpoints", "latest_complete", "load", "prune", "read_meta",
    "remove_partial", "resume_newest", "save", "wait_for_pending",
]
