"""A DeepSpeed script with ``bf16.enabled``, run unchanged on the real DeepSpeed and on the
drop-in: for ZeRO stage 0 (over torch's AdamW and over DeepSpeed's FusedAdam), 1 and 2 in
turn, 6 optimizer steps (accumulation 2, clipping, a warm-up schedule) of a tiny model fed
bfloat16 inputs, then ``save_16bit_model``.

Usage: bf16_script.py [MODE CHECKPOINT_DIR] RECORD
  MODE save: 3 steps, then save_checkpoint(CHECKPOINT_DIR/NAME); resume: load_checkpoint
  (CHECKPOINT_DIR/NAME), then the steps up to 6. Without MODE: 6 steps.
RECORD.NAME (rank 0, NAME one of :data:`RUNS`) gets the steps, learning rates, losses, gradient
norms, the module's parameter dtypes and the saved file's dtypes; RECORD.NAME.pt the final
parameters.
"""

import os
import sys
from typing import Any

import torch
from common import out_path, write_record

STEPS, SAVE_AT, MICRO, ACCUMULATION = 6, 3, 4, 2
# name: (ZeRO stage, torch_adam); DeepSpeed wraps its FusedAdam and other optimizers differently.
RUNS = {"stage0": (0, True), "stage0_fused": (0, False), "stage1": (1, True), "stage2": (2, True)}


def build(deepspeed: Any, stage: int, torch_adam: bool = True) -> Any:
    """The seeded tiny model wrapped by ``deepspeed.initialize`` with DeepSpeed's bf16."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4))
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATION,
              "gradient_clipping": 0.5, "steps_per_print": float("inf"), "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": torch_adam}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train(engine: Any, stop: int = STEPS) -> dict[str, Any]:
    """Optimizer steps from the engine's step count up to ``stop``: each one's learning rate,
    last micro-batch loss and gradient norm."""
    record: dict[str, Any] = {"steps": [], "lrs": [], "losses": [], "grad_norms": []}
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(MICRO, 8, generator=generator), torch.randn(MICRO, 4, generator=generator))
            for _ in range(STEPS * ACCUMULATION)]
    for micro in range(engine.global_steps * ACCUMULATION, stop * ACCUMULATION):
        inputs, targets = data[micro]
        loss = torch.nn.functional.mse_loss(engine(inputs.to(torch.bfloat16)).float(), targets)
        engine.backward(loss)
        engine.step()
        if (micro + 1) % ACCUMULATION == 0:
            record["steps"].append(engine.global_steps)
            record["lrs"].append(engine.get_lr()[0])
            record["losses"].append(loss.item())
            record["grad_norms"].append(float(engine.get_global_grad_norm()))
    return record


def main() -> None:
    import deepspeed

    path = out_path()
    mode, checkpoints = (sys.argv[1], sys.argv[2]) if len(sys.argv) > 3 else ("full", "")
    for name, (stage, torch_adam) in RUNS.items():
        engine = build(deepspeed, stage, torch_adam)
        if mode == "resume":
            engine.load_checkpoint(os.path.join(checkpoints, name))
        record = train(engine, SAVE_AT if mode == "save" else STEPS)
        if mode == "save":
            engine.save_checkpoint(os.path.join(checkpoints, name))
        record["dtypes"] = sorted({str(p.dtype) for p in engine.module.parameters()})
        saved = os.path.join(os.path.dirname(path), name)
        engine.save_16bit_model(saved)
        weights = torch.load(os.path.join(saved, "pytorch_model.bin"), weights_only=True)
        record["saved_dtypes"] = sorted({str(v.dtype) for v in weights.values()})
        write_record(f"{path}.{name}", record, engine.module)


if __name__ == "__main__":
    main()
