"""Hugging Face's Trainer, Accelerate and Lightning scripts with a DeepSpeed config, run
unchanged once on the real DeepSpeed (CPU, no op build) and once under
``python -m hybridtrain.deepspeed`` with no DeepSpeed installed: the same optimizer steps,
learning rates, losses (and gradient norms) and final parameters, before and after a save
and resume through each framework's own checkpoint logic.

The config: ZeRO-2 with the optimizer offloaded to the CPU, "auto" wherever the framework
fills it in, gradient accumulation 2, a warm-up schedule, gradient clipping, 6 steps. With bf16
(ZeRO-2 without offload) each framework's run is the real DeepSpeed's to the bit.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.deepspeed.frameworks import SCRIPTS, assert_same_run, finish, record, run_both, start

pytest.importorskip("deepspeed")  # the reference
pytest.importorskip("transformers")


def _config(tmp: Path, name: str, **changes: Any) -> str:
    import sys

    sys.path.insert(0, str(SCRIPTS))
    try:
        from common import DS_CONFIG
    finally:
        sys.path.remove(str(SCRIPTS))
    config = copy.deepcopy(DS_CONFIG)
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(config))
    return str(path)


def _assert_both_runs(theirs: Path, ours: Path) -> None:
    for part in ("full", "resumed"):
        assert_same_run(Path(f"{ours}.{part}"), Path(f"{theirs}.{part}"))
    resumed = json.loads(Path(f"{ours}.resumed").read_text())
    assert resumed["steps"][-1] == 6


def test_hf_trainer_same_as_deepspeed(tmp_path: Path) -> None:
    """``TrainingArguments(deepspeed=ds.json)`` with a WarmupDecayLR schedule, all "auto":
    steps, learning rates, losses, gradient norms, parameters; resume from checkpoint-3 through
    the Trainer's own logic; ``save_model`` writes what ``from_pretrained`` loads."""
    scheduler = {"type": "WarmupDecayLR", "params": {k: "auto" for k in (
        "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")}}
    config = _config(tmp_path, "trainer", scheduler=scheduler)
    theirs, ours = run_both("trainer_script.py", [config, "{work}"], tmp_path)
    _assert_both_runs(theirs, ours)
    record = json.loads(Path(f"{ours}.full").read_text())
    assert len(record["steps"]) == 6 and record["lrs"][0] == 0.0 and max(record["lrs"]) == pytest.approx(1e-2)

    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(ours.parent / "final").state_dict()
    final = torch.load(f"{ours}.full.pt")
    for name, value in saved.items():
        torch.testing.assert_close(value, final[name], rtol=0, atol=0)


def test_accelerate_same_as_deepspeed(tmp_path: Path) -> None:
    """``accelerate launch --use_deepspeed --deepspeed_config_file ds.json`` (its environment)
    over a plain Accelerate loop: all 6 optimizer steps are taken (Accelerate says where the
    accumulation boundary is), the script's own scheduler drives them; save_state/load_state."""
    config = _config(tmp_path, "accelerate")
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": config,
           "ACCELERATE_GRADIENT_CLIPPING": "0.5"}
    theirs, ours = run_both("accelerate_script.py", ["{work}"], tmp_path, env)
    _assert_both_runs(theirs, ours)
    assert json.loads(Path(f"{ours}.full").read_text())["steps"] == [1, 2, 3, 4, 5, 6]


def _assert_same_bits(theirs: Path, ours: Path) -> None:
    """Every recorded number and final weight the same bits, before and after the resume."""
    for part in ("full", "resumed"):
        mine, my_params = record(Path(f"{ours}.{part}"))
        real, real_params = record(Path(f"{theirs}.{part}"))
        for key in ("steps", "lrs", "losses", "grad_norms"):
            assert mine.get(key) == real.get(key), (part, key)
        assert all(torch.equal(my_params[name], value) for name, value in real_params.items()), part


def test_hf_trainer_bf16_same_as_deepspeed_bit_for_bit(tmp_path: Path) -> None:
    """``TrainingArguments(bf16=True)`` filling ``bf16.enabled: "auto"``, ZeRO-2 without offload:
    DeepSpeed's bf16 math (:mod:`hybridtrain.deepspeed.master_weights`), the same bits as the real
    DeepSpeed's (gradient norms too), through the Trainer's checkpoint-3 resume; ``save_model``
    writes bfloat16 weights."""
    config = _config(tmp_path, "trainer", zero_optimization={"stage": 2})
    theirs, ours = run_both("trainer_script.py", [config, "{work}"], tmp_path, {"TRAINER_BF16": "1"})
    _assert_both_runs(theirs, ours)
    _assert_same_bits(theirs, ours)
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(ours.parent / "final", torch_dtype="auto").state_dict()
    assert {v.dtype for v in saved.values()} == {torch.bfloat16}


@pytest.mark.timeout(300)
def test_hf_trainer_bf16_on_two_ranks_with_offload_same_as_deepspeed_bit_for_bit(tmp_path: Path) -> None:
    """``TrainingArguments(bf16=True)`` on 2 processes (``hybridtrain launch`` against ``torchrun``
    on the real DeepSpeed), ZeRO-2 with the optimizer offloaded to the CPU, the Trainer's own AdamW:
    DeepSpeed's bf16 math over several ranks (:mod:`hybridtrain.deepspeed.zero_gradients`), the
    same bits as the real DeepSpeed's through the Trainer's checkpoint-3 resume."""
    config = _config(tmp_path, "trainer")
    theirs, ours = run_both("trainer_script.py", [config, "{work}"], tmp_path, {"TRAINER_BF16": "1"}, nproc=2)
    _assert_both_runs(theirs, ours)
    _assert_same_bits(theirs, ours)


def test_accelerate_bf16_same_as_deepspeed_bit_for_bit(tmp_path: Path) -> None:
    """The Accelerate loop over a Llama with ``bf16.enabled`` and ZeRO-2 (no offload): DeepSpeed's
    bf16 math (bfloat16 weights, fp32 masters; :mod:`hybridtrain.deepspeed.master_weights`), so
    every loss and final weight is the same bits as the real DeepSpeed's, before and after
    save_state/load_state."""
    config = _config(tmp_path, "accelerate", zero_optimization={"stage": 2}, bf16={"enabled": True}, fp16=None)
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": config,
           "ACCELERATE_GRADIENT_CLIPPING": "0.5", "ACCELERATE_MIXED_PRECISION": "bf16"}
    theirs, ours = run_both("accelerate_script.py", ["{work}"], tmp_path, env)
    _assert_both_runs(theirs, ours)
    _assert_same_bits(theirs, ours)


def test_lightning_bf16_same_as_deepspeed_bit_for_bit(tmp_path: Path) -> None:
    """``Trainer(precision="bf16-mixed", strategy=DeepSpeedStrategy(config=ds.json))`` under
    ZeRO-2 without offload: DeepSpeed's bf16 math, the same bits as the real DeepSpeed's,
    through Lightning's save_checkpoint and ``fit(ckpt_path=…)``."""
    pytest.importorskip("lightning")
    config = _config(tmp_path, "lightning", train_micro_batch_size_per_gpu=None, train_batch_size=None,
                     gradient_accumulation_steps=None, gradient_clipping=None, bf16=None, fp16=None,
                     zero_optimization={"stage": 2})
    theirs, ours = run_both("lightning_script.py", [config, "{work}"], tmp_path, {"LIGHTNING_PRECISION": "bf16-mixed"})
    _assert_both_runs(theirs, ours)
    _assert_same_bits(theirs, ours)


def test_lightning_same_as_deepspeed(tmp_path: Path) -> None:
    """``Trainer(strategy=DeepSpeedStrategy(config=ds.json), accumulate_grad_batches=2,
    gradient_clip_val=0.5)``: Lightning fills batch size, accumulation and clipping itself (no
    "auto"); save_checkpoint after 3 steps, ``fit(ckpt_path=…)`` resumes."""
    pytest.importorskip("lightning")
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}, "overlap_comm": True,
            "contiguous_gradients": True}
    config = _config(tmp_path, "lightning", train_micro_batch_size_per_gpu=None, train_batch_size=None,
                     gradient_accumulation_steps=None, gradient_clipping=None, bf16=None, fp16=None,
                     zero_optimization=zero)
    theirs, ours = run_both("lightning_script.py", [config, "{work}"], tmp_path)
    _assert_both_runs(theirs, ours)

    # hybridtrain's Lightning strategy: `python script.py`, the CPU allowed, same records.
    work = tmp_path / "strategy"
    work.mkdir()
    finish(start("lightning_script.py", [config, str(work), str(work / "record")], tmp_path, False,
                 {"HYBRIDTRAIN_LIGHTNING_STRATEGY": "1"}, dropin=False), "hybridtrain's Lightning strategy run")
    _assert_both_runs(theirs, work / "record")


@pytest.mark.timeout(300)
def test_hf_trainer_zero3_on_two_ranks_same_as_deepspeed(tmp_path: Path) -> None:
    """``hybridtrain launch --nproc-per-node 2`` against ``torchrun`` on the real DeepSpeed:
    ZeRO-3 with the optimizer offloaded, the Trainer's own AdamW (two parameter groups) rebuilt
    over the shards; then ``save_model`` with ``stage3_gather_16bit_weights_on_model_save``
    writes the trained weights whole, which ``from_pretrained`` loads (transformers#25368)."""
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "stage3_gather_16bit_weights_on_model_save": True}
    scheduler = {"type": "WarmupDecayLR", "params": {k: "auto" for k in (
        "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")}}
    config = _config(tmp_path, "zero3", zero_optimization=zero, scheduler=scheduler)
    theirs, ours = run_both("trainer_script.py", [config, "{work}"], tmp_path, nproc=2)
    _assert_both_runs(theirs, ours)

    from transformers import AutoModelForCausalLM

    final = torch.load(f"{ours}.full.pt")
    for saved_by in (ours, theirs):
        saved = AutoModelForCausalLM.from_pretrained(saved_by.parent / "final").state_dict()
        for name, value in saved.items():
            torch.testing.assert_close(value, final[name], rtol=1e-4, atol=1e-6)
