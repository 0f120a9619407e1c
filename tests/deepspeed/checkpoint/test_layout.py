"""DeepSpeed's checkpoint layout under the drop-in, without the real DeepSpeed: a checkpoint
the real DeepSpeed 0.19.8 wrote (``data/``, see its README) resumes here; what
``save_checkpoint`` writes is DeepSpeed's layout, plain data, and resumes exactly; a crafted
file runs no code."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hybridtrain.deepspeed as deepspeed
from hybridtrain.deepspeed.checkpoint import files
from hybridtrain.deepspeed.checkpoint.files import UnreadableDeepSpeedFile
from tests.deepspeed.frameworks import SCRIPTS

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="module")
def script() -> Iterator[Any]:
    """tests/deepspeed/scripts/checkpoint_script.py as a module (its build and train)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        import checkpoint_script

        yield checkpoint_script
    finally:
        sys.path.remove(str(SCRIPTS))


def _new_record() -> dict[str, list[Any]]:
    return {"steps": [], "lrs": [], "losses": []}


def _weights(engine: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def test_a_real_deepspeed_checkpoint_resumes_here(script: Any) -> None:
    """The real DeepSpeed's ZeRO-2 checkpoint loads bit for bit, with its client state, step
    and schedule, and the run continues as the real DeepSpeed's run straight through."""
    engine = script.build(deepspeed, 2)
    path, client_state = engine.load_checkpoint(DATA / "real_zero2")
    assert Path(path) == DATA / "real_zero2" / "global_step3" / "mp_rank_00_model_states.pt"
    assert client_state["epoch"] == 7 and engine.global_steps == 3
    saved = torch.load(DATA / "real_zero2_weights.pt", weights_only=True)
    assert all(torch.equal(value, saved[name]) for name, value in _weights(engine).items())
    record = _new_record()
    script.train(engine, script.STEPS, record)
    real = json.loads((DATA / "real_zero2_full.json").read_text())
    assert record["steps"] == real["steps"][3:] and record["lrs"] == real["lrs"][3:]
    torch.testing.assert_close(torch.tensor(record["losses"]), torch.tensor(real["losses"][3:]), rtol=1e-6, atol=0)
    final = torch.load(DATA / "real_zero2_full.json.pt", weights_only=True)
    for name, value in _weights(engine).items():
        torch.testing.assert_close(value, final[name], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("stage", [0, 2])
def test_save_writes_deepspeeds_layout_as_plain_data_and_resumes_exactly(tmp_path: Path, script: Any,
                                                                         stage: int) -> None:
    """``save_checkpoint`` writes DeepSpeed's files (every one readable by torch's
    ``weights_only`` loader with no allowlist); a run resumed from them ends bit for bit as
    the run straight through."""
    straight = script.build(deepspeed, stage)
    straight_record = _new_record()
    script.train(straight, script.STEPS, straight_record)

    saving = script.build(deepspeed, stage)
    script.train(saving, script.SAVE_AT, _new_record())
    saving.save_checkpoint(tmp_path, client_state={"epoch": 7})
    tag = tmp_path / "global_step3"
    expected = {"mp_rank_00_model_states.pt"} | ({"zero_pp_rank_0_mp_rank_00_optim_states.pt"} if stage else set())
    assert {p.name for p in tag.iterdir()} == expected
    assert (tmp_path / "latest").read_text() == "global_step3"
    assert (tmp_path / "zero_to_fp32.py").is_file() == bool(stage)
    for file in tag.iterdir():
        torch.load(file, weights_only=True)
    states = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=True)
    assert states["global_steps"] == 3 and states["epoch"] == 7 and states["dp_world_size"] == 1
    assert (states["param_shapes"] is None) == (stage == 0)

    resumed = script.build(deepspeed, stage)
    resumed.load_checkpoint(tmp_path)
    record = _new_record()
    script.train(resumed, script.STEPS, record)
    assert record["losses"] == straight_record["losses"][3:] and record["lrs"] == straight_record["lrs"][3:]
    assert all(torch.equal(value, _weights(straight)[name]) for name, value in _weights(resumed).items())


def test_zero3_save_writes_deepspeeds_files_and_resumes_exactly(tmp_path: Path, script: Any) -> None:
    """ZeRO-3: a model-states and an optimizer file per rank with the keys of the real
    DeepSpeed's (``data/real_zero3_dp2``), its static loss scaler the one class in them (read
    through the stand-ins); a run resumed from them ends bit for bit as the run straight through."""
    straight = script.build(deepspeed, 3)
    straight_record = _new_record()
    script.train(straight, script.STEPS, straight_record)
    saving = script.build(deepspeed, 3)
    script.train(saving, script.SAVE_AT, _new_record())
    saving.save_checkpoint(tmp_path, client_state={"epoch": 7})
    tag = tmp_path / "global_step3"
    assert {p.name for p in tag.iterdir()} == {"zero_pp_rank_0_mp_rank_00_model_states.pt",
                                               "zero_pp_rank_0_mp_rank_00_optim_states.pt"}
    real = DATA / "real_zero3_dp2" / "global_step3"
    for name in ("model_states", "optim_states"):
        mine = files.read(tag / f"zero_pp_rank_0_mp_rank_00_{name}.pt")
        theirs = files.read(real / f"zero_pp_rank_0_mp_rank_00_{name}.pt")
        assert mine.keys() == theirs.keys(), name
    optimizer = files.read(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")[files.OPTIMIZER_STATE_DICT]
    real_optimizer = files.read(real / "zero_pp_rank_0_mp_rank_00_optim_states.pt")[files.OPTIMIZER_STATE_DICT]
    assert optimizer.keys() == real_optimizer.keys()
    assert vars(optimizer["loss_scaler"]) == vars(real_optimizer["loss_scaler"]) == {"cur_scale": 1.0, "dynamic": False}

    resumed = script.build(deepspeed, 3)
    resumed.load_checkpoint(tmp_path)
    record = _new_record()
    script.train(resumed, script.STEPS, record)
    assert record["losses"] == straight_record["losses"][3:] and record["lrs"] == straight_record["lrs"][3:]
    assert all(torch.equal(value, _weights(straight)[name]) for name, value in _weights(resumed).items())


def test_load_options_keep_what_they_say(tmp_path: Path, script: Any) -> None:
    """``load_module_only`` restores the weights only; ``load_optimizer_states=False`` keeps
    the optimizer's state; without ``latest`` and tag nothing loads, as DeepSpeed."""
    fresh = script.build(deepspeed, 2)
    assert fresh.load_checkpoint(tmp_path) == (None, None)
    fresh.load_checkpoint(DATA / "real_zero2", load_module_only=True)
    assert fresh.global_steps == 0 and not fresh.optimizer.state
    saved = torch.load(DATA / "real_zero2_weights.pt", weights_only=True)
    assert all(torch.equal(value, saved[name]) for name, value in _weights(fresh).items())
    other = script.build(deepspeed, 2)
    other.load_checkpoint(DATA / "real_zero2", load_optimizer_states=False)
    assert other.global_steps == 3 and not other.optimizer.state


@pytest.mark.parametrize("victim", ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_a_crafted_checkpoint_file_runs_no_code(tmp_path: Path, script: Any, victim: str) -> None:
    """A file whose pickle would call ``os.system`` is refused in one line before anything runs."""
    marker = tmp_path / "ran"

    class Crafted:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return os.system, (f"touch {marker}",)

    checkpoint = tmp_path / "ckpt"
    shutil.copytree(DATA / "real_zero2", checkpoint)
    torch.save({"module": {}, "payload": Crafted()}, checkpoint / "global_step3" / victim)
    engine = script.build(deepspeed, 2)
    with pytest.raises(UnreadableDeepSpeedFile, match="is not plain checkpoint data"):
        engine.load_checkpoint(checkpoint)
    assert not marker.exists()


def test_a_callers_scheduler_still_drives_the_optimizer_after_a_load(tmp_path: Path) -> None:
    """Accelerate and Lightning step their own scheduler over the optimizer they gave: after
    ``load_checkpoint`` its rates are still the ones the engine trains with."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    given = torch.optim.AdamW(model.parameters(), lr=0.1)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=given, config=config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    engine.backward(engine(torch.ones(2, 3)).sum())
    engine.step()
    engine.save_checkpoint(tmp_path)
    engine.load_checkpoint(tmp_path)
    scheduler.step()
    assert engine.get_lr() == [0.05] == [group["lr"] for group in optimizer.param_groups]


def test_a_real_zero3_checkpoint_of_two_ranks_loads_here_in_one_process(script: Any) -> None:
    """Every parameter put back together from both ranks' ZeRO-3 slices: the weights the run had,
    its client state and step; its optimizer state reaches this run's optimizer."""
    engine = script.build(deepspeed, 3)
    path, client_state = engine.load_checkpoint(DATA / "real_zero3_dp2")
    assert Path(path).name == "zero_pp_rank_0_mp_rank_00_model_states.pt"
    assert client_state["epoch"] == 7 and engine.global_steps == 3
    saved = torch.load(DATA / "real_zero3_dp2_weights.pt", weights_only=True)
    assert all(torch.equal(value, saved[name]) for name, value in _weights(engine).items())
    steps = {float(s["step"]) for s in engine.optimizer.state.values()}
    assert steps == {3.0} and len(engine.optimizer.state) == 4


class _Scalars(torch.nn.Module):
    """``y = a·x + b`` with 0-dim parameters, as transformers' ``RegressionPreTrainedModel``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Parameter(torch.tensor(0.0)), torch.nn.Parameter(torch.tensor(0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.a + self.b


@pytest.mark.parametrize("stage", [1, 2])
def test_0_dim_parameters_resume_exactly(tmp_path: Path, stage: int) -> None:
    """Each 0-dim parameter's Adam moments are written flat with the group's, as DeepSpeed's, not
    the first parameter's for the whole group (which the Trainer's resume of transformers'
    regression model met)."""
    config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "torch_adam": True}}}
    generator = torch.Generator().manual_seed(0)
    data = [torch.randn(8, generator=generator) for _ in range(6)]

    def train(engine: Any, batches: list[torch.Tensor]) -> None:
        for x in batches:
            engine.backward(((engine(x) - (2 * x + 3)) ** 2).mean())
            engine.step()

    engine, *_ = deepspeed.initialize(model=_Scalars(), config=config)
    train(engine, data[:3])
    engine.save_checkpoint(tmp_path)
    train(engine, data[3:])
    resumed, *_ = deepspeed.initialize(model=_Scalars(), config=config)
    resumed.load_checkpoint(tmp_path)
    train(resumed, data[3:])
    mine, theirs = _weights(resumed), _weights(engine)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_zero3_drops_an_empty_optimizer_group_from_its_files_and_resumes_exactly(tmp_path: Path) -> None:
    """The HF Trainer's no-decay group is empty for transformers' regression model: DeepSpeed drops
    empty groups before ZeRO-3 builds its sub-groups, so its files hold one; written with the empty
    one, the optimizer state was not read back (transformers' zero3 resume with the Trainer's AdamW)."""
    config = {"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    generator = torch.Generator().manual_seed(0)
    data = [torch.randn(8, generator=generator).bfloat16() for _ in range(6)]

    def build() -> Any:
        model = _Scalars()
        groups = [{"params": list(model.parameters()), "weight_decay": 0.01}, {"params": [], "weight_decay": 0.0}]
        return deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=0.1), config=config)[0]

    def train(engine: Any, batches: list[torch.Tensor]) -> None:
        for x in batches:
            engine.backward(((engine(x).float() - (2 * x.float() + 3)) ** 2).mean())
            engine.step()

    engine = build()
    train(engine, data[:3])
    engine.save_checkpoint(tmp_path)
    train(engine, data[3:])
    optimizer_file = torch.load(next(tmp_path.glob("global_step3/bf16_*optim_states.pt")), weights_only=False)
    assert len(optimizer_file[files.OPTIMIZER_STATE_DICT]["fp32_flat_groups"]) == 1
    resumed = build()
    resumed.load_checkpoint(tmp_path)
    train(resumed, data[3:])
    mine, theirs = _weights(resumed), _weights(engine)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_an_autocast_fp16_run_resumes_with_its_loss_scale(tmp_path: Path) -> None:
    """ZeRO-2 with the optimizer offloaded and fp32 gradient accumulation keeps the engine's
    autocast and loss scaler: the scale (shrunk by the first steps' overflows, grown after a
    window) is written as DeepSpeed's ``DynamicLossScaler`` and resumed, so the resumed run is
    the uninterrupted one."""
    config = {"train_micro_batch_size_per_gpu": 8, "zero_force_ds_cpu_optimizer": False,
              "data_types": {"grad_accum_dtype": "fp32"},  # not DeepSpeed's fp16 wrapper's math: autocast
              "fp16": {"enabled": True, "initial_scale_power": 24, "loss_scale_window": 2},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "torch_adam": True}}}
    generator = torch.Generator().manual_seed(0)
    data = [torch.randn(8, 4, generator=generator) for _ in range(8)]

    def linear() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Linear(4, 1)  # a matmul: autocast runs it, and its gradients, in fp16

    def train(engine: Any, batches: list[torch.Tensor]) -> list[float]:
        scales = []
        for x in batches:
            engine.backward((engine(x).float() - x.sum(1, keepdim=True)).pow(2).mean())
            engine.step()
            scales.append(engine.loss_scale)
        return scales

    engine, *_ = deepspeed.initialize(model=linear(), config=config)
    train(engine, data[:4])
    assert engine.skipped_steps > 0 and engine.loss_scale < 2.0**24
    engine.save_checkpoint(tmp_path)
    scales = train(engine, data[4:])
    resumed, *_ = deepspeed.initialize(model=linear(), config=config)
    resumed.load_checkpoint(tmp_path)
    assert train(resumed, data[4:]) == scales and resumed.skipped_steps == engine.skipped_steps
    resumed.engine.wait_for_updates()
    engine.engine.wait_for_updates()
    mine, theirs = _weights(resumed), _weights(engine)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
