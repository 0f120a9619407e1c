"""A DeepSpeed ZeRO-3 script with ``bf16.enabled`` and then ``fp16.enabled``, run unchanged on the
real DeepSpeed and on the drop-in, on one process or several: :mod:`fp16_script`'s model and
8 optimizer steps (accumulation 2, clipping, a warm-up, overflows at the start, where the fp16
scale grows and at an infinite gradient), each rank on its own data.

Usage: zero3_half_script.py [MODE CHECKPOINT_DIR] RECORD
  MODE save: 4 steps, then save_checkpoint(CHECKPOINT_DIR/PRECISION); resume: load_checkpoint from
  there, then the steps up to 8. Without MODE: 8 steps.
RECORD.PRECISION (rank 0) gets each step's learning rate, loss (rank 0's), gradient norm, loss
scale before and after, skip count and applied flag; RECORD.PRECISION.pt the final half weights
(gathered); a resume also the weights as loaded (RECORD.PRECISION.loaded.pt).
"""

import os
import sys

import torch
from common import out_path, write_record
from fp16_script import SAVE_AT, STEPS, build, train

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> None:
    import deepspeed

    args = sys.argv[1:-1]
    mode, checkpoints = (args[0], args[1]) if args else ("full", "")
    rank = int(os.environ.get("RANK", "0"))
    for precision, dtype in PRECISIONS.items():
        engine = build(deepspeed, precision, False, 3, True)
        directory = os.path.join(checkpoints, precision)
        record_path = f"{out_path()}.{precision}"
        if mode == "resume":
            engine.load_checkpoint(directory)
            write_record(record_path + ".loaded", {}, engine.module)
        record = train(engine, dtype, SAVE_AT if mode == "save" else STEPS, seed=1 + rank)
        if mode == "save":
            engine.save_checkpoint(directory)
        write_record(record_path, record, engine.module)


if __name__ == "__main__":
    main()
