"""A DeepSpeed ZeRO-3 script with ``bf16.enabled`` and then ``fp16.enabled``, run unchanged on the
real DeepSpeed and on the drop-in, on one process or several: :mod:`fp16_script`'s model and
8 optimizer steps (accumulation 2, clipping, a warm-up, overflows at the start, where the fp16
scale grows and at an infinite gradient) of the script's own AdamW with two parameter groups (as
the HF Trainer passes it), each rank on its own data.

Usage: zero3_half_script.py SAVE_DIR RESUME_DIR RECORD [SETUP…] (``-`` for a directory: not done)
  SETUP: the runs below once per setup (none given: once, without offload), options joined by
  ``+``: ``offload`` the optimizer offloaded to the host, ``offloadparam`` the parameters; ``none``:
  without offload. A setup's records are RECORD-SETUP…, its checkpoints under DIR/SETUP.
  SAVE_DIR: 8 steps, with save_checkpoint(SAVE_DIR/PRECISION) after the 4th; RECORD.PRECISION
  (rank 0) gets each step's learning rate, loss (rank 0's), gradient norm, loss scale before and
  after, skip count and applied flag, RECORD.PRECISION.pt the final half weights (gathered),
  RECORD.PRECISION.at_save.pt the weights saved.
  RESUME_DIR: then load_checkpoint(RESUME_DIR/PRECISION) into a new engine and the steps up to 8,
  recorded as RECORD.PRECISION.resumed (the weights as loaded in RECORD.PRECISION.resumed.loaded.pt).
Tests call :func:`run` in process too (:func:`tests.deepspeed.frameworks.run_dropin`).
"""

import os
import sys
from typing import Any

import torch
from common import write_record
from fp16_script import SAVE_AT, STEPS, build, train

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}


def run(deepspeed: Any, args: list[str]) -> None:
    """What the command line ``args`` say (see the module), with ``deepspeed`` the package to run."""
    save_dir, resume_dir, record_path, *setups = args
    for setup in setups or [""]:
        options = "".join(f"-{option}" for option in setup.split("+") if option not in ("", "none"))
        for precision, dtype in PRECISIONS.items():
            path = f"{record_path}{'-' + setup if setup else ''}.{precision}"
            where = os.path.join(setup, precision)
            if save_dir != "-":
                engine = build(deepspeed, precision + options, 3, True, two_groups=True)
                record = train(engine, dtype, SAVE_AT)
                engine.save_checkpoint(os.path.join(save_dir, where))
                write_record(f"{path}.at_save", {}, engine.module)
                rest = train(engine, dtype, STEPS)
                write_record(path, {k: v + rest[k] if isinstance(v, list) and k != "dtypes" else rest[k]
                                    for k, v in record.items()}, engine.module)
            if resume_dir != "-":
                engine = build(deepspeed, precision + options, 3, True, two_groups=True)
                engine.load_checkpoint(os.path.join(resume_dir, where))
                write_record(f"{path}.resumed.loaded", {}, engine.module)
                write_record(f"{path}.resumed", train(engine, dtype, STEPS), engine.module)


if __name__ == "__main__":
    import deepspeed

    run(deepspeed, sys.argv[1:])
