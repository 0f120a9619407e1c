"""A DeepSpeed script with ``fp16.enabled`` (or ``bf16.enabled``), run unchanged on the real
DeepSpeed and on the drop-in: for ZeRO stage 0 (over torch's AdamW and over DeepSpeed's
FusedAdam), 1 and 2 in turn (:data:`RUNS`), 8 optimizer steps (accumulation 2, clipping, a
warm-up schedule) of a tiny model fed half inputs, with a gradient made infinite at one
micro-batch, so that steps overflow: at the start (fp16's initial scale is too large), where the
scale grows again (a window of 2), and at the infinite gradient; then ``save_16bit_model``.

With ZeRO-Offload the runs are ZeRO stages 1 and 2 only; on several processes (each rank its own
data) ZeRO stage 0 over torch's AdamW, 1 and 2 (ZeRO-0's averaging is the engine's, ZeRO-1/2's
their wrapper's).

Usage: fp16_script.py [MODE CHECKPOINT_DIR] VARIANT… RECORD
  VARIANT fp16 (``consecutive_hysteresis`` off), fp16-consecutive or bf16; ``-comm32`` added:
  gradients averaged in fp32 (``communication_data_type``); ``-predivide``: averaged without
  ``reduce_scatter`` in buckets of 100 elements, divided by a ``gradient_predivide_factor`` of 2
  first; ``-offload``:
  ZeRO-Offload (``offload_optimizer.device: cpu``) over torch's AdamW; ``-cpuadam``: ZeRO-Offload
  over the config's AdamW, which DeepSpeed steps with its DeepSpeedCPUAdam. MODE save: 4 steps,
  then save_checkpoint(CHECKPOINT_DIR/VARIANT/NAME); resume: load_checkpoint from there, then the
  steps up to 8; through: 8 steps, saving there after the 4th. Without MODE: 8 steps.
RECORD.VARIANT.NAME (rank 0) gets each step's learning rate, loss, gradient norm, the loss scale before
and after it, the skipped-step count, whether the step applied, the module's parameter dtypes
and ``save_16bit_model``'s, the fp32 master elements rank 0 holds; RECORD.NAME.pt the final
parameters (the fp32 masters are not among them: the module's half weights are).
"""

import os
import sys
from typing import Any

import torch
from common import out_path, write_record

STEPS, SAVE_AT, MICRO, ACCUMULATION, INFINITE_AT = 8, 4, 4, 2, 9  # micro-batch 9: step 5's second
MODES = ("save", "resume", "through")
# name: (ZeRO stage, torch_adam); DeepSpeed wraps its FusedAdam and other optimizers differently.
RUNS = {"stage0": (0, True), "stage0_fused": (0, False), "stage1": (1, True), "stage2": (2, True)}
RANK, WORLD = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def names(variant: str) -> dict[str, tuple[int, bool]]:
    """The runs of ``variant``: with ZeRO-Offload the ZeRO stages 1 and 2 (whose offload DeepSpeed's
    ZeRO wrapper does); on several processes not ZeRO-0 over FusedAdam (whose C++ kernel rounds
    apart from torch's Adam, so that one process compares it within a half step; its averaging
    is stage0's); else all of them."""
    zero_only = "offload" in variant or "cpuadam" in variant
    return {name: run for name, run in RUNS.items()
            if (not zero_only or run[0] > 0) and (WORLD == 1 or name != "stage0_fused")}


class _Infinite(torch.autograd.Function):
    """Identity whose backward makes the gradient infinite when ``armed``."""

    armed = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf") if _Infinite.armed else grad


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.norm, self.second = torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.norm(_Infinite.apply(self.first(x)))))


def build(deepspeed: Any, variant: str, stage: int, torch_adam: bool, two_groups: bool = False) -> Any:
    """The seeded model under ``deepspeed.initialize``; with ``two_groups`` the script's own torch
    AdamW with the weights and the rest in two groups (decay and none), as the HF Trainer gives it,
    instead of the config's optimizer."""
    torch.manual_seed(0)
    model = Model()
    precision, *options = variant.split("-")
    half = {"enabled": True}
    if precision == "fp16":
        half.update({"initial_scale_power": 19, "loss_scale_window": 2, "hysteresis": 2,
                     "consecutive_hysteresis": "consecutive" in options, "min_loss_scale": 1})
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATION,
              "gradient_clipping": 0.5, "steps_per_print": float("inf"), precision: half,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": torch_adam}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 8, "warmup_max_lr": 1e-2}},
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    if "comm32" in options:
        config["communication_data_type"] = "fp32"
    if "predivide" in options:
        config.update(gradient_predivide_factor=2.0,
                      zero_optimization={"stage": stage, "reduce_scatter": False, "reduce_bucket_size": 100})
    if "offload" in options or "cpuadam" in options:  # cpuadam: DeepSpeed steps its DeepSpeedCPUAdam
        config["zero_optimization"] = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
        config["optimizer"]["params"]["torch_adam"] = "cpuadam" not in options
    if "offloadparam" in options:  # ZeRO-3 with its parameters offloaded to the host as well
        config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    optimizer = None
    if two_groups:
        config.pop("optimizer")
        matrices = [p for p in model.parameters() if p.dim() > 1]
        rest = [p for p in model.parameters() if p.dim() <= 1]
        groups = [{"params": matrices, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=1e-2)
        config["zero_force_ds_cpu_optimizer"] = False  # offloaded, step this torch AdamW (no cpu_adam build)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=optimizer,
                                           config=config)
    return engine


def scale(engine: Any) -> float:
    """The loss scale DeepSpeed's wrapper keeps (stage 0's in its ``loss_scale_config``)."""
    optimizer = engine.optimizer
    config = getattr(optimizer, "loss_scale_config", None)
    return float(config.cur_scale if config is not None else optimizer.cur_scale)


def train(engine: Any, dtype: torch.dtype, stop: int = STEPS) -> dict[str, Any]:
    """Optimizer steps from the engine's step count up to ``stop``, each one's record."""
    record: dict[str, Any] = {k: [] for k in ("lrs", "losses", "grad_norms", "scales", "skipped", "applied")}
    generator = torch.Generator().manual_seed(1 + RANK)  # each rank its own data
    data = [(torch.randn(MICRO, 8, generator=generator), torch.randn(MICRO, 4, generator=generator))
            for _ in range(STEPS * ACCUMULATION)]
    for micro in range(engine.global_steps * ACCUMULATION, stop * ACCUMULATION):
        inputs, targets = data[micro]
        _Infinite.armed = micro == INFINITE_AT and RANK == 0  # one rank's overflow skips every rank
        loss = torch.nn.functional.mse_loss(engine(inputs.to(dtype)).float(), targets)
        before = scale(engine)
        engine.backward(loss)
        engine.step()
        if (micro + 1) % ACCUMULATION == 0:
            record["lrs"].append(engine.get_lr()[0])
            record["losses"].append(loss.item())
            record["grad_norms"].append(float(engine.get_global_grad_norm()))
            record["scales"].append([before, scale(engine)])
            record["skipped"].append(engine.skipped_steps)
            record["applied"].append(engine.was_step_applied())
    record["steps"] = engine.global_steps
    record["dtypes"] = sorted({str(p.dtype) for p in engine.module.parameters()})
    # The fp32 master elements this rank holds (ZeRO-1/2 on several ranks: its partition; ZeRO-0: all).
    record["master_elements"] = sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                                    for group in engine.optimizer.param_groups for p in group["params"])
    return record


def main() -> None:
    import deepspeed

    args = sys.argv[1:-1]
    mode, checkpoints = (args.pop(0), args.pop(0)) if args[0] in MODES else ("full", "")
    for variant in args:
        dtype = torch.float16 if variant.startswith("fp16") else torch.bfloat16
        for name, (stage, torch_adam) in names(variant).items():
            engine = build(deepspeed, variant, stage, torch_adam)
            directory = os.path.join(checkpoints, variant, name)
            if mode == "resume":
                engine.load_checkpoint(directory)
            record = train(engine, dtype, STEPS if mode in ("full", "resume") else SAVE_AT)
            if mode in ("save", "through"):
                engine.save_checkpoint(directory)
            if mode == "through":
                rest = train(engine, dtype)
                record = {k: record[k] + v if isinstance(v, list) and k != "dtypes" else v for k, v in rest.items()}
            saved = os.path.join(os.path.dirname(out_path()), f"{os.path.basename(out_path())}-{variant}-{name}")
            engine.save_16bit_model(saved)
            if RANK == 0:
                weights = torch.load(os.path.join(saved, "pytorch_model.bin"), weights_only=True)
                record["saved_dtypes"] = sorted({str(v.dtype) for v in weights.values()})
            write_record(f"{out_path()}.{variant}.{name}", record, engine.module)


if __name__ == "__main__":
    main()
