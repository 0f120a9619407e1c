"""What the three framework scripts share: the tiny model, the data, the DeepSpeed config
and the record each run writes (steps, learning rates, losses, final parameters)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

VOCAB, SEQ, SAMPLES = 64, 8, 24  # 24 samples / micro-batch 2 / accumulation 2 = 6 optimizer steps
MICRO, ACCUMULATION, LR, WARMUP, CLIP = 2, 2, 1e-2, 3, 0.5

# ZeRO-2 with the optimizer offloaded to the CPU, "auto" wherever a framework fills it in.
# zero_force_ds_cpu_optimizer: false lets the real DeepSpeed step torch's AdamW on the CPU
# instead of building its DeepSpeedCPUAdam op (a C++ JIT build); the math is the same.
DS_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                          "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto"},
    "zero_force_ds_cpu_optimizer": False,
    "zero_allow_untested_optimizer": True,
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "steps_per_print": float("inf"),
    "wall_clock_breakdown": False,
}


def tiny_llama() -> torch.nn.Module:
    """A two-layer Llama built from its config (no download), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    return LlamaForCausalLM(config)


def token_data() -> torch.Tensor:
    return torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(1))


def which_deepspeed() -> str:
    """Where ``import deepspeed`` led: hybridtrain's drop-in or the real package."""
    import deepspeed

    return f"{deepspeed.__name__} {deepspeed.__version__}"


def write_record(path: str, record: dict[str, Any], model: torch.nn.Module) -> None:
    """The run's record as JSON, its final parameters beside it (``.pt``); rank 0 writes.
    Call it on every rank: parameters sharded over the ranks are gathered first."""
    from torch.distributed.tensor import DTensor

    params = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().cpu().clone()
              for k, v in model.state_dict().items()}
    if int(os.environ.get("RANK", "0")) != 0:
        return
    record["deepspeed"] = which_deepspeed()
    torch.save(params, path + ".pt")
    Path(path).write_text(json.dumps(record))


def out_path() -> str:
    return sys.argv[-1]
