"""``deepspeed.zero.Init`` and transformers' ``from_pretrained`` under a live ZeRO-3 config, run
unchanged on the real DeepSpeed and on the drop-in, with one or two processes.

Usage: zero_init_script.py MODEL_DIR RECORD
  MODEL_DIR: where rank 0 saves a tiny Llama (seeded: the same on both systems) to load from.
RECORD.init and RECORD.hf (rank 0) get, per parameter, what each rank holds after construction
(``numel()``, ``ds_numel``, ``ds_shape``, the partition's size and status) and whether the gathered
values are the ones built whole; then the losses of 3 ZeRO-3 steps from the partitioned model and
from the same model built whole. RECORD.init also has a parameter changed under
``GatheredParameters(modifier_rank=0)`` and read back on every rank. RECORD.bf16 gets the
parameters' and partitions' dtypes under a bf16 config and the losses of 3 ZeRO-3 bf16 steps from
the partitioned and the whole model.
"""

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from common import out_path, write_record

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": float("inf"),
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
          "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}


def tiny() -> torch.nn.Module:
    """Odd sizes, so the last rank's partition is padded."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))


def tiny_llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, max_position_embeddings=16)


def partitions(model: torch.nn.Module, whole: dict[str, torch.Tensor], deepspeed: Any) -> dict[str, Any]:
    """What this rank holds of each parameter, and whether gathering gives the whole values."""
    held = {name: [p.numel(), int(p.ds_numel), list(p.ds_shape), int(p.ds_tensor.numel()), p.ds_status.name]
            for name, p in model.named_parameters()}
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        same = {name: bool(torch.equal(p.detach(), whole[name])) for name, p in model.named_parameters()}
    return {"held": held, "gathered_equal": same, "after_gather": [p.numel() for p in model.parameters()]}


def losses(deepspeed: Any, model: torch.nn.Module, batches: list[Any], loss: Any,
           config: dict[str, Any] = CONFIG) -> list[float]:
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    out = []
    for batch in batches:
        value = loss(engine, batch)
        engine.backward(value)
        engine.step()
        out.append(value.item())
    return out


def plain_part(deepspeed: Any) -> dict[str, Any]:
    whole = {k: v.clone() for k, v in tiny().state_dict().items()}
    with deepspeed.zero.Init(config_dict_or_path=CONFIG):
        model = tiny()
    record = partitions(model, whole, deepspeed)
    weight = model[2].weight
    with deepspeed.zero.GatheredParameters(weight, modifier_rank=0):
        if dist.get_rank() == 0:
            with torch.no_grad():
                weight.fill_(0.25)
    with deepspeed.zero.GatheredParameters(weight, modifier_rank=None):
        record["modified"] = bool((weight == 0.25).all())
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    batches = [(torch.randn(2, 7, generator=generator), torch.randn(2, 3, generator=generator)) for _ in range(3)]

    def mse(engine: Any, batch: Any) -> torch.Tensor:
        return torch.nn.functional.mse_loss(engine(batch[0]), batch[1])

    record["losses"] = losses(deepspeed, model, batches, mse)
    reference = tiny()
    with torch.no_grad():
        reference[2].weight.fill_(0.25)
    record["whole_losses"] = losses(deepspeed, reference, batches, mse)
    write_record(f"{out_path()}.init", record, torch.nn.Module())  # the losses are compared
    return record


def bf16_part(deepspeed: Any) -> None:
    """``zero.Init`` under a bf16 config: the partitions in bfloat16, as DeepSpeed casts them, and
    3 ZeRO-3 steps with DeepSpeed's bf16 math from them and from the model built whole."""
    config = {**CONFIG, "bf16": {"enabled": True}}
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = tiny()
    record: dict[str, Any] = {"dtypes": sorted({f"{p.dtype} {p.ds_tensor.dtype}" for p in model.parameters()})}
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    batches = [(torch.randn(2, 7, generator=generator).bfloat16(), torch.randn(2, 3, generator=generator))
               for _ in range(3)]

    def mse(engine: Any, batch: Any) -> torch.Tensor:
        return torch.nn.functional.mse_loss(engine(batch[0]).float(), batch[1])

    record["losses"] = losses(deepspeed, model, batches, mse, config)
    record["whole_losses"] = losses(deepspeed, tiny(), batches, mse, config)
    write_record(f"{out_path()}.bf16", record, torch.nn.Module())


def hf_part(deepspeed: Any, model_dir: str) -> None:
    from transformers import LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    if dist.get_rank() == 0:
        torch.manual_seed(0)
        saved = LlamaForCausalLM(tiny_llama_config())
        saved.save_pretrained(model_dir)
        torch.save(saved.state_dict(), os.path.join(model_dir, "whole.pt"))
    dist.barrier()

    config = {**CONFIG, "train_batch_size": 2 * dist.get_world_size()}
    keep = HfDeepSpeedConfig(config)  # what the Trainer does before from_pretrained: ZeRO-3 is live
    model = LlamaForCausalLM.from_pretrained(model_dir)
    whole = torch.load(os.path.join(model_dir, "whole.pt"), weights_only=True)
    record = partitions(model, whole, deepspeed)
    del keep
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    batches = [torch.randint(0, 48, (2, 8), generator=generator) for _ in range(3)]

    def causal(engine: Any, batch: torch.Tensor) -> torch.Tensor:
        return engine(input_ids=batch, labels=batch).loss

    record["losses"] = losses(deepspeed, model, batches, causal)
    reference = LlamaForCausalLM(tiny_llama_config())
    reference.load_state_dict(whole)
    record["whole_losses"] = losses(deepspeed, reference, batches, causal)
    write_record(f"{out_path()}.hf", record, torch.nn.Module())


def main() -> None:
    import deepspeed

    deepspeed.init_distributed()
    model_dir = sys.argv[1]
    plain_part(deepspeed)
    bf16_part(deepspeed)
    hf_part(deepspeed, model_dir)


if __name__ == "__main__":
    main()
