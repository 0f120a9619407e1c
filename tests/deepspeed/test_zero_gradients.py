"""DeepSpeed's bf16/fp16 math on several processes under ZeRO-0, 1 and 2
(:mod:`hybridtrain.deepspeed.zero_gradients`): side by side with the real DeepSpeed 0.19.8 on
2 CPU processes (gloo), to the bit, a checkpoint crossing both ways; and the pieces."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hybridtrain.config import load_config
from hybridtrain.deepspeed.building import master_weights
from hybridtrain.deepspeed.zero_gradients import averaging_from_config, partition_slices, reduction_buckets
from tests.deepspeed.frameworks import finish, record, start
from tests.deepspeed.test_master_weights import _reported_unscaled

# fp16 averaged in fp16 (reduce_scatter's order), bf16 averaged in fp32 (communication_data_type),
# fp16 without reduce_scatter over a gradient_predivide_factor of 2, fp16 under ZeRO-Offload.
VARIANTS = ("fp16", "bf16-comm32", "fp16-predivide", "fp16-offload")


def names(variant: str) -> tuple[str, ...]:
    """The runs fp16_script.py makes of ``variant`` on 2 processes (its ``names``): ZeRO-0 over
    torch's AdamW (``FP16_UnfusedOptimizer``, the engine averaging) unless offloaded, ZeRO-1/2."""
    return ("stage1", "stage2") if "offload" in variant else ("stage0", "stage1", "stage2")


def _as_reported_here(record: dict[str, Any], name: str) -> dict[str, Any]:
    """A real DeepSpeed ``record`` with its gradient norms as the drop-in reports them (of the
    unscaled gradients; ZeRO-0's wrapper reports the scaled ones)."""
    return {**record, "grad_norms": _reported_unscaled(record, name)}
KEYS = ("lrs", "losses", "grad_norms", "scales", "skipped", "applied")


def _both(tmp: Path, mode: str, where: dict[str, Path], prefix: str) -> None:
    """``fp16_script.py MODE DIR VARIANTS…`` on 2 processes on each system at once."""
    runs = [(system, start("fp16_script.py", [mode, str(where[system]), *VARIANTS, str(tmp / f"{prefix}{system}")],
                           tmp, real=system == "real", env={"HYBRIDTRAIN_REFERENCE_FP16": "1"}, nproc=2))
            for system in ("real", "ours")]
    for system, process in runs:
        finish(process, f"{system} fp16_script {mode} on 2 processes")


def test_two_ranks_train_and_resume_as_the_real_deepspeed_bit_for_bit(tmp_path: Path) -> None:
    """8 steps on 2 ranks under ZeRO-0, 1 and 2, each rank its own data, accumulation 2, clipping, a warm-up: fp16 steps
    overflow at the start, where the scale grows back (a window of 2) and where rank 0 alone
    meets an infinite gradient (every rank skips). Every learning rate, loss, gradient norm,
    loss scale, skip and final weight is the real DeepSpeed's to the bit: the arithmetic is the
    same (half gradients divided and summed in the same dtypes, the same fp32 masters and Adam,
    the norm over the same partitions summed by the same collective; ZeRO-0's engine averaging the
    whole gradients at the boundary). Saved after step 4 on each system and resumed on the other,
    the last 4 steps are the uninterrupted run's. Under ZeRO-1/2 each rank holds only its part of
    the fp32 masters, as DeepSpeed's; under ZeRO-0 all of them, as DeepSpeed's."""
    pytest.importorskip("deepspeed")  # the reference
    saved = {"real": tmp_path / "real-ckpt", "ours": tmp_path / "our-ckpt"}
    _both(tmp_path, "through", saved, "")
    _both(tmp_path, "resume", {"real": saved["ours"], "ours": saved["real"]}, "resumed-")
    for variant in VARIANTS:
        for name in names(variant):
            ours, our_params = record(tmp_path / f"ours.{variant}.{name}")
            real, real_params = record(tmp_path / f"real.{variant}.{name}")
            assert "+hybridtrain" in ours["deepspeed"] and "+hybridtrain" not in real["deepspeed"]
            real = _as_reported_here(real, name)
            for key in (*KEYS, "steps", "dtypes"):
                assert ours[key] == real[key], (variant, name, key, ours[key], real[key])
            assert ours["dtypes"] == [f"torch.{'float16' if variant.startswith('fp16') else 'bfloat16'}"]
            # ZeRO-1/2: each rank holds its part of the fp32 masters (1/2 here), no more than DeepSpeed's
            # rank 0; ZeRO-0: the whole of them, as DeepSpeed's.
            elements = sum(v.numel() for v in real_params.values())
            if name == "stage0":
                assert ours["master_elements"] == real["master_elements"] == elements
            else:
                assert ours["master_elements"] <= real["master_elements"] < elements
            if variant.startswith("fp16"):
                assert ours["applied"].count(False) == ours["skipped"][-1] >= 3, (variant, name)
            for key, value in real_params.items():
                assert torch.equal(our_params[key], value), (variant, name, key)
            for resumed, whole in (("ours", real), ("real", ours)):  # theirs resumed here, ours there
                mine, my_params = record(tmp_path / f"resumed-{resumed}.{variant}.{name}")
                mine = _as_reported_here(mine, name) if resumed == "real" else mine
                for key in KEYS:
                    assert mine[key] == whole[key][-4:], (resumed, variant, name, key, mine[key], whole[key])
                assert mine["steps"] == whole["steps"]
                for key, value in real_params.items():
                    assert torch.equal(my_params[key], value), (resumed, variant, name, key)
    assert {p.name for p in (saved["ours"] / "fp16" / "stage2" / "global_step4").iterdir()} == {
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"}
    for directory in saved.values():  # ZeRO-0: rank 0 writes the one file, the optimizer inside, as DeepSpeed's
        assert {p.name for p in (directory / "fp16" / "stage0" / "global_step4").iterdir()} == {
            "mp_rank_00_model_states.pt"}


def test_deepspeeds_partitions_cut_the_flat_group_padded_to_twice_the_world() -> None:
    # 3 + 4 + 6 = 13 elements, padded to 16 over 2 ranks: partitions of 8, the last with 3 of padding.
    assert partition_slices([3, 4, 6], world=2, rank=0) == [(0, 0, 3), (1, 0, 4), (2, 0, 1)]
    assert partition_slices([3, 4, 6], world=2, rank=1) == [(2, 1, 5)]
    # 13 over 4 ranks: padded to 16, partitions of 4; a tensor can span three partitions.
    assert [partition_slices([1, 12], world=4, rank=r) for r in range(4)] == [
        [(0, 0, 1), (1, 0, 3)], [(1, 3, 4)], [(1, 7, 4)], [(1, 11, 1)]]
    assert partition_slices([2], world=4, rank=3) == []  # all padding


def test_gradients_cross_in_buckets_of_reduce_bucket_size() -> None:
    assert reduction_buckets([3, 4, 6, 2], limit=7) == [[0, 1], [2], [3]]
    assert reduction_buckets([9, 1], limit=4) == [[0], [1]]  # a tensor bigger than a bucket goes alone
    assert averaging_from_config({"zero_optimization": {"reduce_bucket_size": 2e5}}, 2, torch.float16
                                 ).bucket_elements == 200_000


def test_the_averaging_keys_read_as_deepspeed_reads_them() -> None:
    rule = averaging_from_config({}, stage=2, half=torch.bfloat16)
    assert (rule.partition_gradients, rule.communication_dtype, rule.reduce_scatter) == (True, torch.bfloat16, True)
    rule = averaging_from_config({"communication_data_type": "FP32", "prescale_gradients": True,
                                  "zero_optimization": {"reduce_scatter": False}}, stage=1, half=torch.float16)
    assert (rule.partition_gradients, rule.communication_dtype, rule.postscale) == (False, torch.float32, False)
    # ZeRO-0's engine: no reduce-scatter, any predivide factor, prescale by multiplying by 1 / world.
    rule = averaging_from_config({"gradient_predivide_factor": 4, "prescale_gradients": True}, stage=0,
                                 half=torch.bfloat16)
    assert (rule.partition_gradients, rule.reduce_scatter, rule.predivide_factor, rule.prescale_multiplies) == (
        False, False, 4.0, True)
    with pytest.raises(ValueError, match=r"^gradient_predivide_factor: 4.0 needs zero_optimization.reduce_scatter"):
        averaging_from_config({"gradient_predivide_factor": 4}, stage=2, half=torch.float16)
    with pytest.raises(ValueError, match=r"^communication_data_type: 'int8' is not one of \['bf16', 'fp16', 'fp32'\]"):
        averaging_from_config({"communication_data_type": "int8"}, stage=2, half=torch.float16)


@pytest.mark.parametrize(("extra", "expected"), [
    ({"zero_optimization": {"stage": 1}}, True),
    ({"zero_optimization": {"stage": 2}}, True),
    ({}, True),  # ZeRO-0: the engine averages the whole gradients
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, False),  # autocast
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}, True),  # ZeRO-Offload
])
def test_several_processes_take_deepspeeds_math_under_zero_0_1_and_2(monkeypatch: pytest.MonkeyPatch,
                                                                  extra: dict[str, Any], expected: bool) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    raw = {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True}, **extra}
    assert master_weights(raw, load_config(dict(raw))) is expected
