"""DeepSpeed ZeRO-3's bf16/fp16 math under the drop-in (:mod:`hybridtrain.deepspeed.runtime.zero.stage3_masters`):
half partitioned weights, fp32 master shards, ``stage3.py``'s overflow check, norm, clip and scale.

Side by side with the real DeepSpeed 0.19.8 on this CPU, on one and two gloo processes, without
offload and with the optimizer (and the parameters) offloaded to the host: every
step's learning rate, loss, gradient norm, loss scale, skip and applied flag and the final half
weights are the same bits (the two systems' arithmetic is the same: see the module), and the
ZeRO-3 checkpoints each writes in DeepSpeed's layout resume on the other, bit for bit. In
process: the same training against DeepSpeed ZeRO-3's rules written out as a plain loop.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridtrain.deepspeed as deepspeed
from hybridtrain.config import load_config
from hybridtrain.deepspeed.building import master_weights
from hybridtrain.deepspeed.runtime.zero.stage3_masters import (
    Stage3MasterWeights,
    stage3_combined_scale,
    stage3_global_norm,
    stage3_offload_norm,
)
from tests.deepspeed.frameworks import finish, run_dropin, start

SCRIPT = "zero3_half_script.py"
PRECISIONS = ("bf16", "fp16")
RECORDED = ("lrs", "losses", "grad_norms", "scales", "skipped", "applied")


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def _assert_same_weights(mine: Path, theirs: Path) -> None:
    ours, real = torch.load(f"{mine}.pt"), torch.load(f"{theirs}.pt")
    assert ours.keys() == real.keys()
    for key, value in real.items():
        assert torch.equal(ours[key], value), key


# The setups each launch runs (zero3_half_script's SETUP): without offload, with the optimizer and the
# parameters offloaded to the host (on one process this model, with no blocks to stream, keeps its
# parameters on the device, as the drop-in says; the optimizer stays offloaded) and, on two, with the
# optimizer offloaded alone (the half shards stay where FSDP2 keeps them, the masters on the host).
SETUPS = {1: ("none", "offload+offloadparam"), 2: ("none", "offload", "offload+offloadparam")}


@pytest.mark.parametrize("nproc", [1, 2])
def test_zero3_half_trains_saves_and_resumes_as_the_real_deepspeed_bit_for_bit(tmp_path: Path, nproc: int) -> None:
    """One launch of the real DeepSpeed per case (its runs, then resumes of the drop-in's
    checkpoints), between the drop-in's runs and its resumes of the real one's checkpoints (in
    this process on one rank), for each of ``SETUPS``: offloaded, DeepSpeed takes the norm in
    fp32 (without, in fp64), and the drop-in follows it to the same bits."""
    pytest.importorskip("deepspeed")  # the reference
    dirs = {"real": tmp_path / "real-ckpt", "ours": tmp_path / "our-ckpt"}
    out = {"real": tmp_path / "real", "ours": tmp_path / "ours"}
    setups = SETUPS[nproc]
    run_dropin(SCRIPT, [str(dirs["ours"]), "-", str(out["ours"]), *setups], tmp_path, nproc)
    finish(start(SCRIPT, [str(dirs["real"]), str(dirs["ours"]), str(out["real"]), *setups], tmp_path, real=True,
                 env={"HYBRIDTRAIN_REFERENCE_FP16": "1"}, nproc=nproc), f"the real DeepSpeed on {nproc} rank(s)")
    run_dropin(SCRIPT, ["-", str(dirs["real"]), str(out["ours"]), *setups], tmp_path, nproc)
    for setup in setups:
        for precision in PRECISIONS:
            _assert_same_setup(dirs, {k: Path(f"{v}-{setup}.{precision}") for k, v in out.items()}, setup,
                               precision, nproc)
    if nproc == 2:  # DeepSpeed's own zero_to_fp32 reads the drop-in's fp32 master shards as the real ones
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        for setup in setups:
            for precision in PRECISIONS:
                theirs = get_fp32_state_dict_from_zero_checkpoint(str(dirs["real"] / setup / precision))
                ours_fp32 = get_fp32_state_dict_from_zero_checkpoint(str(dirs["ours"] / setup / precision))
                assert ours_fp32.keys() == theirs.keys() and all(torch.equal(ours_fp32[k], theirs[k]) for k in theirs)


def _assert_same_setup(dirs: dict[str, Path], out: dict[str, Path], setup: str, precision: str, nproc: int) -> None:
    """The two systems' runs of one setup and precision (records ``out``, checkpoints under ``dirs``)
    and each one's resume of the other's checkpoint: the same bits."""
    ours, real = _json(out["ours"]), _json(out["real"])
    assert "+hybridtrain" not in real["deepspeed"] and ("+hybridtrain" in ours["deepspeed"] or nproc == 1)
    for key in (*RECORDED, "steps"):
        assert ours[key] == real[key], (setup, precision, key, ours[key], real[key])
    assert ours["dtypes"] == real["dtypes"] == [f"torch.{'bfloat16' if precision == 'bf16' else 'float16'}"]
    assert not all(real["applied"]) and all(real["applied"][5:])  # overflows skipped, then trained
    # Offloaded, DeepSpeed roots the norm in fp32 (without, in fp64): the rule the drop-in followed.
    finite = [n for n in real["grad_norms"] if n != float("inf")]
    assert all(float(torch.tensor(n, dtype=torch.float32)) == n for n in finite) is (setup != "none")
    _assert_same_weights(out["ours"], out["real"])
    prefix = "bf16_" if precision == "bf16" else ""
    names = {f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(nproc)} | {
        f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(nproc)}
    for directory in dirs.values():  # DeepSpeed's file names, as the real one writes them
        assert {p.name for p in (directory / setup / precision / "global_step4").iterdir()} == names
        assert (directory / setup / precision / "latest").read_text().strip() == "global_step4"
    for system, saver in (("ours", "real"), ("real", "ours")):  # each resumes the other's checkpoint
        resumed = Path(f"{out[system]}.resumed")
        _assert_same_weights(Path(f"{resumed}.loaded"), Path(f"{out[saver]}.at_save"))
        for key in RECORDED:  # the saver's run, continued: loss scale and skip count included
            assert _json(resumed)[key] == _json(out[saver])[key][4:], (setup, precision, system)
        _assert_same_weights(resumed, out[saver])


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.norm, self.second = nn.Linear(6, 12), nn.LayerNorm(12), nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.norm(self.first(x))))


def _plain_zero3_bf16(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float,
                      clip: float) -> tuple[list[float], list[torch.Tensor]]:
    """DeepSpeed ZeRO-3's bf16 rules on one rank as a plain loop: bfloat16 weights, fp32 masters
    (no init step), gradients summed in bfloat16 over 2 micro-batches, the norm of their fp64
    norms, clipped by ``clamp((norm + 1e-6) / clip, min=1)`` in fp64, AdamW on the masters, copied
    back. Returns the gradient norms and the final masters."""
    params = list(model.parameters())
    for p in params:
        p.data = p.data.bfloat16()
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    optimizer = torch.optim.AdamW(masters, lr=lr, weight_decay=0.1)
    norms = []
    for step in range(0, len(batches), 2):
        for inputs, targets in batches[step:step + 2]:
            (F.mse_loss(model(inputs.bfloat16()).float(), targets) / 2).backward()
        norm = torch.stack([p.grad.double().norm() for p in params]).pow(2).sum().sqrt()
        divisor = torch.clamp((norm + 1e-6) / clip, min=1.0)
        norms.append(float(norm))
        for p, m in zip(params, masters, strict=True):
            m.grad = p.grad.float() * (1.0 / divisor)
            p.grad = None
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(params, masters, strict=True):
                p.copy_(m)
    return norms, masters


def test_one_process_trains_with_deepspeed_zero3_bf16_rules() -> None:
    torch.manual_seed(0)
    model, reference = _Net(), _Net()
    reference.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 6, generator=generator), torch.randn(4, 3, generator=generator)) for _ in range(8)]
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.3,
              "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.1, "torch_adam": True}}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert isinstance(optimizer, Stage3MasterWeights) and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    norms = []
    for index, (inputs, targets) in enumerate(batches):
        engine.backward(F.mse_loss(engine(inputs.bfloat16()).float(), targets))
        engine.step()
        if index % 2:
            norms.append(engine.get_global_grad_norm())
    expected_norms, expected = _plain_zero3_bf16(reference, batches, lr=0.05, clip=0.3)
    assert norms == expected_norms and max(norms) > 0.3  # the clip acted
    masters = [m for group in optimizer.param_groups for m in group["params"]]
    for mine, theirs in zip(masters, expected, strict=True):
        assert torch.equal(mine, theirs)
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_the_norm_is_fp64_and_an_inf_or_nan_is_infinite() -> None:
    generator = torch.Generator().manual_seed(2)
    groups = [[torch.randn(5, 3, generator=generator).bfloat16(), torch.randn(7, generator=generator).bfloat16()],
              [torch.randn(4, generator=generator).bfloat16()]]
    norm = stage3_global_norm(groups)
    flat = torch.cat([g.double().reshape(-1) for group in groups for g in group])
    assert norm.dtype == torch.float64 and torch.isclose(norm, flat.norm(), rtol=1e-15, atol=0)
    assert stage3_global_norm([[torch.tensor([1.0, float("nan")])], []]).item() == float("inf")
    assert stage3_combined_scale(norm, 0.0, 8.0) == 8.0  # no clipping: the loss scale alone
    clipped = stage3_combined_scale(norm * 8, float(norm) / 2, 8.0)
    assert isinstance(clipped, torch.Tensor) and clipped.dtype == torch.float64
    assert torch.isclose(clipped, torch.tensor(16.0, dtype=torch.float64), rtol=1e-5)


def test_offloaded_the_norm_is_summed_in_fp64_and_rooted_in_fp32() -> None:
    """DeepSpeed ZeRO-3's ``complete_grad_norm_calculation_for_cpu_offload`` on one rank."""
    generator = torch.Generator().manual_seed(3)
    groups = [[torch.randn(5, 3, generator=generator).bfloat16(), torch.randn(7, generator=generator).bfloat16()],
              [torch.randn(4, generator=generator).bfloat16()]]
    sums = [sum(float(g.double().norm()) ** 2 for g in group) for group in groups]
    per_group = torch.stack([torch.tensor(s, dtype=torch.float32) ** 0.5 for s in sums])
    norm = stage3_offload_norm(groups)
    assert norm.dtype == torch.float32 and torch.equal(norm, torch.linalg.vector_norm(per_group))
    assert stage3_offload_norm([[torch.tensor([1.0, float("nan")])], []]).item() == float("inf")


@pytest.mark.parametrize(("extra", "taken"), [
    ({}, True), ({"fp16": {"enabled": True}, "bf16": {"enabled": False}}, True),
    ({"bf16": {"enabled": False}}, False),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, True),
    # One process offloads the parameters of a model with blocks by layer streaming, which keeps
    # autocast (without blocks, or on two processes: the test above).
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, False),
    ({"data_types": {"grad_accum_dtype": "fp32"}}, False),
])
def test_zero3_takes_deepspeeds_math_where_its_wrapper_would_run(extra: dict[str, object], taken: bool) -> None:
    raw = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
           **extra}
    assert master_weights(raw, load_config(raw)) is taken
