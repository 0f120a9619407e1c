"""Run under ``python -m hybridtrain.deepspeed`` (or ``hybridtrain launch``): prints, as JSON,
what ``import deepspeed`` and the version checks of the frameworks found in this process,
after two ZeRO-2 steps of ``deepspeed.initialize`` on a tiny model. Usage: SCRIPT OUT_PREFIX."""

import importlib.metadata
import importlib.util
import json
import os
import sys

import deepspeed
import deepspeed.ops.adam
import torch
from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES, WarmupLR
from deepspeed.utils import logger

report = {
    "module": deepspeed.__name__, "version": deepspeed.__version__,
    "metadata_version": importlib.metadata.version("deepspeed"),
    "spec_found": importlib.util.find_spec("deepspeed") is not None,
    "same_engine_class": deepspeed.DeepSpeedEngine is deepspeed.runtime.engine.DeepSpeedEngine,
    "submodule": deepspeed.ops.adam.DeepSpeedCPUAdam.__module__, "schedules": VALID_LR_SCHEDULES,
    "logger": logger.name, "warmup": WarmupLR.__module__,
}
# What transformers' tests/deepspeed/test_deepspeed.py imports to decide what to skip.
from deepspeed.ops.aio import AsyncIOBuilder  # noqa: E402
from deepspeed.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint  # noqa: E402, F401

report["aio_compatible"] = deepspeed.ops.__compatible_ops__[AsyncIOBuilder.NAME]
try:
    import deepspeed.not_a_module  # noqa: F401
except ModuleNotFoundError as exc:
    report["missing"] = str(exc)
from lightning_utilities.core.imports import RequirementCache  # noqa: E402

report["lightning_check"] = bool(RequirementCache("deepspeed>=0.16.0"))
from transformers.integrations import is_deepspeed_available  # noqa: E402

report["transformers_check"] = is_deepspeed_available()

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": float("inf"),
          "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.0}}, "zero_optimization": {"stage": 2}}
engine, _, _, _ = deepspeed.initialize(model=model, config=config)
data = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
losses = []
for step in range(2):
    start = 4 * step + 2 * engine.global_rank  # each rank its own 2 samples of the step's 4
    loss = engine(data[start:start + 2]).pow(2).mean()
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
report.update(engine=type(engine).__module__, steps=engine.global_steps, world=engine.world_size, losses=losses)
with open(f"{sys.argv[1]}.{os.environ.get('RANK', '0')}", "w") as out:
    json.dump(report, out)
