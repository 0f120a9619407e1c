"""The DeepSpeed surface the frameworks call, in one process: accumulation boundaries as
Accelerate sets them, the global gradient norm, DeepSpeed's Adam classes and scheduler
classes, ZeRO-3's construction API, 16-bit / fp32 weights out of the engine and its
checkpoints, and a caller's optimizer rebuilt by parameter name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridtrain.deepspeed as deepspeed
from hybridtrain.config import ConfigError
from hybridtrain.deepspeed.client_optimizer import describe, lay_groups, with_optimizer
from hybridtrain.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from hybridtrain.deepspeed.runtime import lr_schedules
from hybridtrain.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from hybridtrain.optim import build_optimizer

ACCUMULATION = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(2, 6, generator=gen), torch.randint(0, 3, (2,), generator=gen)) for _ in range(n)]


@pytest.mark.parametrize("clip", [0.3, 0.0])
def test_accelerate_boundaries_take_every_step_and_report_the_norm(clip: float) -> None:
    """Accelerate's loop: ``set_gradient_accumulation_boundary(sync)`` before each backward,
    ``step()`` at the boundary only = a hand loop with 1/accumulation losses, clipping and
    AdamW every 2 micro-batches; ``get_global_grad_norm`` is the norm before clipping."""
    batches = _batches(6)
    model = _model()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ACCUMULATION,
              "gradient_clipping": clip, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    assert engine.get_global_grad_norm() is None
    norms = []
    for i, (x, y) in enumerate(batches):
        sync = (i + 1) % ACCUMULATION == 0
        engine.set_gradient_accumulation_boundary(sync)
        engine.backward(F.cross_entropy(engine(x), y))
        if sync:
            engine.step()
            norms.append(engine.get_global_grad_norm())
    assert engine.global_steps == 3

    hand = _model()
    optimizer = torch.optim.AdamW(hand.parameters(), lr=1e-2, weight_decay=0.0)
    expected = []
    for i, (x, y) in enumerate(batches):
        (F.cross_entropy(hand(x), y) / ACCUMULATION).backward()
        if (i + 1) % ACCUMULATION == 0:
            expected.append(float(torch.nn.utils.clip_grad_norm_(hand.parameters(), clip or float("inf"))))
            optimizer.step()
            optimizer.zero_grad()
    for mine, theirs in zip(model.parameters(), hand.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7)
    assert norms == pytest.approx(expected, rel=1e-5)


def test_deepspeed_adam_classes_are_torch_adam_with_deepspeeds_modes() -> None:
    params = [nn.Parameter(torch.ones(3))]
    cpu_adam = DeepSpeedCPUAdam(params, lr=0.1, weight_decay=0.1)
    assert isinstance(cpu_adam, torch.optim.Adam) and cpu_adam.defaults["decoupled_weight_decay"]
    assert not FusedAdam(params, adam_w_mode=False).defaults["decoupled_weight_decay"]
    with pytest.raises(NotImplementedError, match="bias_correction=False"):
        DeepSpeedCPUAdam(params, bias_correction=False)


def test_scheduler_classes_match_the_real_deepspeed() -> None:
    real = pytest.importorskip("deepspeed.runtime.lr_schedules")
    assert lr_schedules.VALID_LR_SCHEDULES == real.VALID_LR_SCHEDULES
    for name, params in [("WarmupLR", {"warmup_num_steps": 4}), ("WarmupLR", {}),
                         ("WarmupDecayLR", {"total_num_steps": 10, "warmup_num_steps": 3, "warmup_type": "linear"}),
                         ("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 3})]:
        ours_opt = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.05)
        real_opt = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.05)
        ours, theirs = getattr(lr_schedules, name)(ours_opt, **params), getattr(real, name)(real_opt, **params)
        for _ in range(8):
            assert ours.get_last_lr() == pytest.approx(theirs.get_last_lr(), rel=1e-12), name
            ours.step()
            theirs.step()


def test_zero_init_and_gathered_parameters_on_whole_parameters() -> None:
    with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
        layer = nn.Linear(2, 2)
    with deepspeed.zero.GatheredParameters([layer.weight], modifier_rank=0), torch.no_grad():
        layer.weight.fill_(1.0)  # one process: the modifier's values are everyone's
    assert layer.weight.numel() == 0  # partitioned again, as DeepSpeed leaves it
    with deepspeed.zero.GatheredParameters([layer.weight]):
        assert torch.equal(layer.weight, torch.ones(2, 2))
    deepspeed.zero.register_external_parameter(layer, layer.weight)


def test_16bit_and_fp32_weights_out_of_the_engine(tmp_path: Path) -> None:
    model = _model()
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, optimizer, *_ = deepspeed.initialize(model=model, config=config)
    x, y = _batches(1)[0]
    # DeepSpeed's bf16: the module's weights are bfloat16 (the inputs too), fp32 masters in the optimizer.
    engine.backward(F.cross_entropy(engine(x.bfloat16()).float(), y))
    engine.step()
    assert engine.save_16bit_model(tmp_path / "out", "weights.bin")
    saved = torch.load(tmp_path / "out" / "weights.bin")
    assert all(v.dtype == torch.bfloat16 for v in saved.values())
    for name, value in model.state_dict().items():
        assert torch.equal(saved[name], value)
    engine.save_checkpoint(tmp_path / "ckpt")
    fp32 = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    masters = [m for group in optimizer.param_groups for m in group["params"]]
    for (name, value), master in zip(model.named_parameters(), masters, strict=True):
        assert torch.equal(value, master.to(torch.bfloat16))
        assert fp32[name].dtype == torch.float32 and torch.equal(fp32[name].to(torch.bfloat16), value), name
    assert engine.config["bf16"] == {"enabled": True}  # the config as given, as DeepSpeed's engine.config


def test_a_callers_optimizer_is_rebuilt_with_its_groups_by_name() -> None:
    model = _model()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    given = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                              lr=3e-3, betas=(0.8, 0.9))
    spec = describe(given, model)
    settings = with_optimizer(_config(), spec)
    rebuilt = build_optimizer(model.parameters(), settings.optimizer.type, settings.optimizer.params)
    assert lay_groups(rebuilt, model, spec)
    assert type(rebuilt) is torch.optim.AdamW and len(rebuilt.param_groups) == 2
    for mine, theirs in zip(rebuilt.param_groups, given.param_groups, strict=True):
        assert [id(p) for p in mine["params"]] == [id(p) for p in theirs["params"]]
        assert {k: mine[k] for k in ("lr", "betas", "weight_decay", "eps")} == \
            {k: theirs[k] for k in ("lr", "betas", "weight_decay", "eps")}

    class Custom(torch.optim.SGD):
        pass

    with pytest.raises(ConfigError, match="torch.optim classes"):
        describe(Custom(model.parameters(), lr=0.1), model)


def _config():  # type: ignore[no-untyped-def]
    from hybridtrain.config import load_config

    return load_config({})
