"""``deepspeed.utils.zero_to_fp32`` under the drop-in, on a checkpoint the real DeepSpeed
wrote with two ranks (``tests/deepspeed/checkpoint/data``) and on one the drop-in wrote:
DeepSpeed's functions, the recovery script beside the checkpoint, and Lightning's converter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hybridtrain.deepspeed as deepspeed
from hybridtrain.deepspeed.utils import zero_to_fp32
from tests.deepspeed.frameworks import ROOT, finish, start

DATA = ROOT / "tests" / "deepspeed" / "checkpoint" / "data"


def _assert_same(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert found.keys() == expected.keys()
    for name, value in expected.items():
        assert found[name].dtype == torch.float32 and torch.equal(found[name], value), name


def test_deepspeeds_functions_read_a_two_rank_real_checkpoint(tmp_path: Path) -> None:
    """Both ranks' flat slices (the last one padded) put back together: the weights the run had."""
    expected = torch.load(DATA / "real_zero2_dp2_weights.pt", weights_only=True)
    checkpoint = DATA / "real_zero2_dp2"
    _assert_same(zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(checkpoint), expected)
    _assert_same(zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(checkpoint, tag="global_step3"), expected)
    tag = checkpoint / "global_step3"
    assert zero_to_fp32.get_model_state_file(tag, 2) == str(tag / "mp_rank_00_model_states.pt")
    assert [Path(f).name for f in zero_to_fp32.get_optim_files(tag)] == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(checkpoint, tmp_path / "out")
    _assert_same(torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True), expected)
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(checkpoint, tmp_path / "safe", safe_serialization=True)
    from safetensors.torch import load_file

    _assert_same(load_file(str(tmp_path / "safe" / "model.safetensors")), expected)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    _assert_same(zero_to_fp32.load_state_dict_from_zero_checkpoint(model, checkpoint).state_dict(), expected)
    with pytest.raises(ValueError, match="Unable to find 'latest' file"):
        zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(tag)
    with pytest.raises(FileNotFoundError, match="can't find model states file"):
        zero_to_fp32.get_model_state_file(tag, 3)


def test_a_two_rank_real_zero3_checkpoint_is_read_whole() -> None:
    """ZeRO-3 cuts each parameter over the ranks (the last slice padded): put back exactly."""
    expected = torch.load(DATA / "real_zero3_dp2_weights.pt", weights_only=True)
    _assert_same(zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(DATA / "real_zero3_dp2"), expected)
    tag = DATA / "real_zero3_dp2" / "global_step3"
    assert zero_to_fp32.get_model_state_file(tag, 3) == str(tag / "zero_pp_rank_0_mp_rank_00_model_states.pt")


def _saved_by_the_dropin(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    loss = engine(torch.ones(2, 4)).sum()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(tmp_path / "ckpt", client_state={"epoch": 1})
    return tmp_path / "ckpt", {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_recovery_script_beside_a_dropin_checkpoint_writes_the_fp32_model(tmp_path: Path) -> None:
    """``python zero_to_fp32.py CHECKPOINT OUT``, as DeepSpeed's users run it."""
    checkpoint, expected = _saved_by_the_dropin(tmp_path)
    done = subprocess.run([sys.executable, str(checkpoint / "zero_to_fp32.py"), str(checkpoint),
                           str(tmp_path / "out"), "--max_shard_size", "1GB"],
                          capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    _assert_same(torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True), expected)


def test_lightnings_converter_reads_a_dropin_checkpoint(tmp_path: Path) -> None:
    """Lightning's ``convert_zero_checkpoint_to_fp32_state_dict`` under the drop-in (no DeepSpeed):
    the fp32 weights under ``state_dict`` and the client state beside them."""
    pytest.importorskip("lightning")
    checkpoint, expected = _saved_by_the_dropin(tmp_path)
    out = tmp_path / "lightning.pt"
    finish(start("lightning_convert.py", [str(checkpoint), str(out)], tmp_path, real=False),
           "Lightning's converter under the drop-in")
    converted = torch.load(out, weights_only=True)
    assert converted["epoch"] == 1
    _assert_same(converted["state_dict"], expected)
