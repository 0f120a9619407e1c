"""A DeepSpeed script that saves and resumes with ``engine.save_checkpoint``/``load_checkpoint``,
run unchanged on the real DeepSpeed and on hybridtrain's drop-in (one or several processes).

Usage: checkpoint_script.py STAGE SAVE_DIR RESUME_DIR RECORD (``-`` for a directory: not done)
  SAVE_DIR: 6 optimizer steps, with save_checkpoint(SAVE_DIR, client_state) after the 3rd; RECORD
  (rank 0) gets the steps, learning rates and losses, the kinds of tensor ``module.state_dict()``
  and ``module.parameters()`` hold, RECORD.pt the final parameters,
  RECORD.at_save.pt the parameters saved.
  RESUME_DIR: then load_checkpoint(RESUME_DIR) into a new engine and the steps up to 6, recorded as
  RECORD.resumed, with the client state read back; RECORD.resumed.loaded.pt the weights as loaded.
With CHECKPOINT_OFFLOAD=1 the optimizer is offloaded to the host. Tests import :func:`build` and
:func:`train` to run it in process, and :func:`run` (:func:`tests.deepspeed.frameworks.run_dropin`).
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


def run(deepspeed: Any, args: list[str]) -> None:
    """What the command line ``args`` say (see the module), with ``deepspeed`` the package to run."""
    stage, save_dir, resume_dir, record_path = int(args[0]), args[1], args[2], args[3]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if save_dir != "-":
        engine = build(deepspeed, stage, world)
        record: dict[str, Any] = {"steps": [], "lrs": [], "losses": []}
        train(engine, SAVE_AT, record, world)
        engine.save_checkpoint(save_dir, client_state={"epoch": 7})
        write_record(record_path + ".at_save", {}, engine.module)
        train(engine, STEPS, record, world)
        # What a user reads off the module: DeepSpeed keeps ZeRO-1/2 parameters whole on every rank.
        record["kinds"] = {"state_dict": sorted({type(v).__name__ for v in engine.module.state_dict().values()}),
                           "parameters": sorted({type(p).__name__ for p in engine.module.parameters()})}
        write_record(record_path, record, engine.module)
    if resume_dir != "-":
        engine = build(deepspeed, stage, world)
        path, client_state = engine.load_checkpoint(resume_dir)
        resumed: dict[str, Any] = {"steps": [], "lrs": [], "losses": [], "client_state": {
            "epoch": client_state.get("epoch"), "file": os.path.relpath(path, resume_dir)}}
        write_record(record_path + ".resumed.loaded", {}, engine.module)  # the weights as loaded
        train(engine, STEPS, resumed, world)
        write_record(record_path + ".resumed", resumed, engine.module)


if __name__ == "__main__":
    import deepspeed

    run(deepspeed, sys.argv[1:])
