"""A DeepSpeed script that saves and resumes with ``engine.save_checkpoint``/``load_checkpoint``,
run unchanged on the real DeepSpeed and on hybridtrain's drop-in (one or several processes).

Usage: checkpoint_script.py STAGE MODE CHECKPOINT_DIR RECORD
  MODE full: 6 optimizer steps; save: 3 steps, then save_checkpoint(CHECKPOINT_DIR, client_state);
  resume: load_checkpoint(CHECKPOINT_DIR), then the steps up to 6.
With CHECKPOINT_OFFLOAD=1 the optimizer is offloaded to the host.
RECORD (rank 0) gets the steps, learning rates and losses of the steps run, the client state
read back, and the final parameters (RECORD.pt); a resume also the weights as loaded
(RECORD.loaded.pt). Tests import :func:`build` and :func:`train` to run it in-process.
"""

import os
import sys
from typing import Any

import torch
from common import write_record

STEPS, SAVE_AT, BATCH = 6, 3, 4


def build(deepspeed: Any, stage: int, world: int = 1) -> Any:
    """The seeded tiny model wrapped by ``deepspeed.initialize`` (AdamW, WarmupLR, clipping)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    config = {"train_micro_batch_size_per_gpu": BATCH // world, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.5, "steps_per_print": float("inf"), "zero_allow_untested_optimizer": True,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
              "zero_optimization": {"stage": stage}, "zero_force_ds_cpu_optimizer": False}
    if os.environ.get("CHECKPOINT_OFFLOAD") == "1":  # the optimizer on the host (ZeRO-Offload)
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train(engine: Any, stop: int, record: dict[str, list[Any]], world: int = 1) -> None:
    """Optimizer steps from the engine's step count up to ``stop``, each appended to ``record``."""
    data = torch.randn(STEPS, BATCH, 5, generator=torch.Generator().manual_seed(1))
    rank, share = engine.global_rank, BATCH // world
    for step in range(engine.global_steps, stop):
        loss = engine(data[step][rank * share:(rank + 1) * share]).pow(2).mean()
        engine.backward(loss)
        engine.step()
        record["steps"].append(engine.global_steps)
        record["lrs"].append(engine.get_lr()[0])
        record["losses"].append(loss.item())


def main() -> None:
    import deepspeed

    stage, mode, checkpoint_dir, record_path = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    engine = build(deepspeed, stage, world)
    record: dict[str, Any] = {"steps": [], "lrs": [], "losses": []}
    if mode == "resume":
        path, client_state = engine.load_checkpoint(checkpoint_dir)
        record["client_state"] = {"epoch": client_state.get("epoch"), "file": os.path.relpath(path, checkpoint_dir)}
        write_record(record_path + ".loaded", {}, engine.module)  # the weights as loaded
    train(engine, SAVE_AT if mode == "save" else STEPS, record, world)
    if mode == "save":
        engine.save_checkpoint(checkpoint_dir, client_state={"epoch": 7})
    write_record(record_path, record, engine.module)


if __name__ == "__main__":
    main()
