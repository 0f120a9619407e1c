"""Every DeepSpeed key has one treatment: implemented (a schema key), renamed, accepted
without effect, or refused — all refusals of a file in one line; "auto" resolved or named."""

from __future__ import annotations

import logging

import pytest

from hybridtrain.config import ConfigError, explain_config, load_config
from hybridtrain.config.deepspeed_keys import AUTO_RESOLVED, TREATMENTS, in_schema


def test_each_key_has_exactly_one_treatment() -> None:
    # A schema key may only appear in the table as a refusal of particular values (nvme).
    doubled = [k for k, t in TREATMENTS.items() if in_schema(k) and not (t.kind == "refused" and t.when)]
    assert not doubled
    assert all(in_schema(t.target) for t in TREATMENTS.values() if t.kind == "renamed")
    assert all(in_schema(k) for k in AUTO_RESOLVED)


def test_legacy_names_move_to_the_current_keys() -> None:
    cfg = load_config({"bfloat16": {"enabled": True}, "zero_optimization": {
        "stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": True,
        "stage3_gather_fp16_weights_on_model_save": True}})
    assert cfg.bf16.enabled and cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.zero_optimization.offload_optimizer.pin_memory
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save
    assert load_config({"zero_optimization": True}).zero_optimization.stage == 1


def test_keys_without_effect_load_and_are_said_once(caplog: pytest.LogCaptureFixture) -> None:
    raw = {"prescale_gradients": False, "gradient_predivide_factor": 1.0, "tensorboard": {"enabled": True},
           "zero_optimization": {"stage": 2, "reduce_scatter": True, "allgather_partitions": True,
                                 "sub_group_size": 1e9},
           "activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": True},
           "bf16": {"enabled": True, "loss_scale": 0}}
    with caplog.at_level(logging.INFO, logger="hybridtrain"):
        cfg = load_config(raw)
    assert cfg.bf16.enabled and cfg.zero_optimization.stage == 2
    lines = [r.getMessage() for r in caplog.records if r.name == "hybridtrain.config"]
    assert len(lines) == 1 and "zero_optimization.reduce_scatter (no effect" in lines[0]


def test_every_refusal_of_a_file_in_one_line() -> None:
    with pytest.raises(ConfigError) as err:
        load_config({"amp": {"enabled": True}, "progressive_layer_drop": {"enabled": True},
                     "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}},
                     "steps_per_print": "auto"})
    message = str(err.value)
    assert "\n" not in message
    for needle in ("amp: NVIDIA Apex", "progressive_layer_drop: randomly skips layers",
                   "zero_optimization.offload_param.device = 'nvme': NVMe offload; use device: cpu",
                   'steps_per_print = "auto": nothing in the config determines it'):
        assert needle in message


def test_values_that_change_nothing_are_accepted() -> None:
    cfg, applied = explain_config({"fp16": {"enabled": True, "fp16_master_weights_and_grads": False},
                                   "sequence_parallel_size": 1, "data_types": {"grad_accum_dtype": "fp32"}})
    assert cfg.fp16.enabled
    assert {a.key for a in applied} == {"fp16.fp16_master_weights_and_grads", "sequence_parallel_size", "data_types"}
    with pytest.raises(ConfigError, match="sequence_parallel_size = 4: Ulysses"):
        load_config({"sequence_parallel_size": 4})


def test_auto_resolved_as_the_trainer_would() -> None:
    cfg, applied = explain_config({
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"}})
    assert cfg.train_micro_batch_size_per_gpu == 4 and cfg.train_batch_size is None
    assert cfg.gradient_clipping == 1.0 and not cfg.fp16.enabled and not cfg.bf16.enabled
    assert {a.key for a in applied if a.treatment == "auto"} == {
        "train_batch_size", "gradient_accumulation_steps", "gradient_clipping", "fp16.enabled", "bf16.enabled",
        "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size"}
    # Where only the Trainer's arguments decide, its defaults, each said with what to put there.
    cfg, applied = explain_config({
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "train": {"steps": 300}})
    assert cfg.optimizer.params == {"lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    assert cfg.scheduler is not None and cfg.scheduler.params == {
        "warmup_min_lr": 0.0, "warmup_max_lr": 5e-5, "warmup_num_steps": 1, "total_num_steps": 300}
    assert all("put your value there" in a.note for a in applied)
    with pytest.raises(ConfigError, match=r'steps_per_print = "auto": nothing in the config determines it'):
        load_config({"steps_per_print": "auto"})


def test_deepspeeds_own_optimizers_as_its_engine_takes_them() -> None:
    # deepspeed/runtime/engine.py: the 1-bit optimizers assert no ZeRO; LAMB asserts dynamic loss
    # scaling; under ZeRO or bf16 LAMB's trust ratio would span a flattened partition.
    with pytest.raises(ConfigError) as err:
        load_config({"optimizer": {"type": "ZeroOneAdam"}, "zero_optimization": {"stage": 3}})
    assert "optimizer.type = 'ZeroOneAdam' (0/1 Adam) with zero_optimization.stage = 3: DeepSpeed asserts " \
           "'0/1 Adam is not compatible with ZeRO'; use stage 0" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config({"optimizer": {"type": "OneBitLamb"}, "fp16": {"enabled": True, "loss_scale": 128},
                     "zero_optimization": {"stage": 1}})
    message = str(err.value)
    assert "\n" not in message and "'1-bit LAMB is not compatible with ZeRO'" in message
    assert "with fp16.loss_scale = 128: DeepSpeed asserts it 'requires dynamic loss scaling'" in message
    with pytest.raises(ConfigError, match=r"'Lamb' \(LAMB\) with bf16 and pipeline parallel: DeepSpeed then "
                                          "takes the trust ratio"):
        load_config({"optimizer": {"type": "Lamb"}, "bf16": {"enabled": True}, "pipeline": {"stages": 2}})
    # DeepSpeed's fp16 wrapper takes the fp16 init step on them at stage 0 with fp16: a rule
    # of the DeepSpeed drop-in (hybridtrain.deepspeed.building.takes_fp16_init_step); loading adds nothing.
    for name in ("Lamb", "OnebitAdam", "ZeroOneAdam", "OneBitLamb"):
        for half in ("fp16", "bf16"):
            cfg = load_config({"optimizer": {"type": name, "params": {"lr": 1e-3}}, half: {"enabled": True}})
            assert cfg.optimizer.params == {"lr": 1e-3}


def test_the_init_step_key_is_read_into_the_plan_not_passed_to_the_optimizer() -> None:
    from hybridtrain.plan.resolve import optimizer_settings

    asked = load_config({"optimizer": {"type": "AdamW", "params": {"lr": 0.1, "fp16_init_step": True}}})
    settings = optimizer_settings(asked)
    assert (settings.type, dict(settings.params), settings.fp16_init_step) == ("AdamW", {"lr": 0.1}, True)
    # The user's word decides over the one the DeepSpeed drop-in writes into the config.
    from hybridtrain.deepspeed.building import with_fp16_init_step

    skipped = load_config({"optimizer": {"type": "AdamW", "params": {"lr": 0.1, "fp16_init_step": False}}})
    assert optimizer_settings(with_fp16_init_step(skipped, True)).fp16_init_step is False
    assert optimizer_settings(with_fp16_init_step(load_config({}), True)).fp16_init_step is True
    assert optimizer_settings(with_fp16_init_step(load_config({}), False)).fp16_init_step is False


@pytest.mark.parametrize(("raw", "steps"), [
    # deepspeed/runtime/engine.py, _do_optimizer_sanity_check: no ZeRO and fp16 → FP16, bf16 →
    # DDP_BFLOAT16 (BFLOAT16, whose BF16_Optimizer does not step at build, when pipelined);
    # both go to _configure_fp16_optimizer, whose wrappers step in initialize_optimizer_states.
    ({"fp16": {"enabled": True}}, True),
    ({"bf16": {"enabled": True}}, True),
    ({"bfloat16": {"enabled": True}, "zero_optimization": {"stage": 0}}, True),
    ({"fp16": {"enabled": True}, "pipeline": {"stages": 2}}, True),
    ({"bf16": {"enabled": True}, "pipeline": {"stages": 2}}, False),
    ({"bf16": {"enabled": True}, "pipeline_model_parallel_size": 2}, False),
    # ZeRO stages build their own optimizers (stage_1_and_2.py / stage3.py
    # initialize_optimizer_states make zero gradients but never call step()).
    ({"fp16": {"enabled": True}, "zero_optimization": {"stage": 1}}, False),
    ({"bf16": {"enabled": True}, "zero_optimization": True}, False),
    # fp32, "auto" (the Trainer's default: off) and torch_autocast (fp32 parameters): no wrapper.
    ({}, False),
    ({"fp16": {"enabled": "auto"}}, False),
    ({"torch_autocast": {"enabled": True, "dtype": "torch.float16"}}, False),
])
def test_fp16_init_step_where_deepspeed_wraps_the_optimizer(raw: dict, steps: bool) -> None:
    from hybridtrain.config.deepspeed_keys import deepspeed_takes_fp16_init_step
    from hybridtrain.deepspeed.building import takes_fp16_init_step

    assert deepspeed_takes_fp16_init_step(raw) is steps
    # The drop-in steps every optimizer, not only DeepSpeed's own: the config's, or a caller's;
    # without either DeepSpeed has none (hybridtrain's default takes no step). Loading adds nothing.
    for optimizer in ({"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
                      {"type": "Adam", "params": {"adam_w_mode": False}}, {"type": "SGD", "params": {"lr": 0.1}}):
        assert takes_fp16_init_step({**raw, "optimizer": optimizer}, client=False) is steps
        cfg, applied = explain_config({**raw, "optimizer": optimizer})
        assert cfg.optimizer.params == optimizer["params"]
        assert not [a for a in applied if "fp16_init_step" in a.key]
    assert takes_fp16_init_step(raw, client=True) is steps
    assert takes_fp16_init_step(raw, client=False) is False


def test_an_explicit_init_step_setting_is_kept() -> None:
    cfg = load_config({"optimizer": {"type": "Adam", "params": {"fp16_init_step": False}}, "fp16": {"enabled": True}})
    assert cfg.optimizer.params == {"fp16_init_step": False}
    # No optimizer section: nothing is added (the drop-in steps a caller's optimizer itself).
    assert load_config({"fp16": {"enabled": True}}).optimizer.params == {"lr": 1e-3}
