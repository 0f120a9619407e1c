"""``deepspeed.zero.Init`` partitions as DeepSpeed does (:mod:`hybridtrain.deepspeed.runtime.zero.partitioning`):
in process on one rank, and side by side with the real DeepSpeed 0.19.8 on two, transformers'
``from_pretrained`` under a live ZeRO-3 config included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridtrain.deepspeed as deepspeed
from tests.deepspeed.frameworks import finish, record, start

CONFIG = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def _tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3))


def _train(model: nn.Module) -> list[float]:
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        loss = F.mse_loss(engine(torch.randn(2, 7, generator=generator)), torch.randn(2, 3, generator=generator))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_init_partitions_gathers_and_trains_as_the_whole_model() -> None:
    whole = _tiny()
    with deepspeed.zero.Init(config_dict_or_path=CONFIG):
        model = _tiny()
    weight = model[0].weight
    assert weight.numel() == 0 and weight.ds_numel == 91 and tuple(weight.ds_shape) == (13, 7)
    assert weight.ds_tensor.numel() == 91 and weight.ds_status.name == "NOT_AVAILABLE"  # one rank: all of it
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        for mine, theirs in zip(model.parameters(), whole.parameters(), strict=True):
            assert torch.equal(mine, theirs)
            mine.data.zero_()  # no modifier_rank: discarded, as in DeepSpeed
    assert weight.numel() == 0
    with deepspeed.zero.GatheredParameters(weight, modifier_rank=0):
        assert weight.shape == (13, 7)
        with torch.no_grad():
            weight.mul_(2)  # the modifier's change is kept
    with torch.no_grad():
        whole[0].weight.mul_(2)
    assert _train(model) == _train(whole)


def test_a_nested_init_and_init_of_an_existing_module() -> None:
    with deepspeed.zero.Init(), deepspeed.zero.Init():
        inner = nn.Linear(3, 5)
    assert inner.weight.ds_numel == 15 and inner.weight.numel() == 0
    existing = nn.Linear(4, 2)
    deepspeed.zero.Init(module=existing)
    assert existing.weight.ds_tensor.numel() == 8 and existing.bias.numel() == 0
    with deepspeed.zero.Init(enabled=False):
        plain = nn.Linear(2, 2)
    assert not hasattr(plain.weight, "ds_tensor") and plain.weight.numel() == 4


def test_two_ranks_partition_and_train_as_the_real_deepspeed(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")  # the reference
    runs = [(system, start("zero_init_script.py", [str(tmp_path / f"llama-{system}"), str(tmp_path / system)], tmp_path,
                           real=system == "real", nproc=2)) for system in ("real", "ours")]
    for system, process in runs:
        finish(process, f"{system} zero_init_script", timeout=400)
    for part in ("init", "hf"):
        ours, real = record(tmp_path / f"ours.{part}")[0], record(tmp_path / f"real.{part}")[0]
        assert ours["held"] == real["held"], part  # numel() 0, ds_numel, ds_shape, each rank's share, status
        assert all(ours["gathered_equal"].values()) and all(real["gathered_equal"].values()), part
        assert ours["after_gather"] == real["after_gather"] == [0] * len(ours["held"])
        assert ours["losses"] == ours["whole_losses"], part  # partitioned first or not: the same training
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(real["losses"]), rtol=1e-4, atol=0)
    assert record(tmp_path / "ours.init")[0]["modified"] and record(tmp_path / "real.init")[0]["modified"]
    ours, real = record(tmp_path / "ours.bf16")[0], record(tmp_path / "real.bf16")[0]
    assert ours["dtypes"] == real["dtypes"] == ["torch.bfloat16 torch.bfloat16"]  # cast as DeepSpeed's Init casts
    # Kept partitioned through initialize (stage3_masters.set_aside_partitions): the same training as from the
    # whole model, and as the real DeepSpeed's, bit for bit (ZeRO-3's bf16 math on both).
    assert ours["losses"] == ours["whole_losses"] == real["losses"] == real["whole_losses"]
