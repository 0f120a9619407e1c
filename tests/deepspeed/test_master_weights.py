"""DeepSpeed's bf16 and fp16 math under the drop-in (:mod:`hybridtrain.deepspeed.master_weights`):
half weights, fp32 masters, DeepSpeed's loss scale, norm and clip arithmetic.

Side by side with the real DeepSpeed 0.19.8 on this CPU (its bf16 runs on the CPU
accelerator; fp16 once it is told the CPU supports it, see ``scripts/real_deepspeed.py``):
every step's learning rate, loss, gradient norm, loss scale and skip, and the final weights,
are the same bits for ZeRO-0 (both of its wrappers), ZeRO-1 and ZeRO-2, overflowing steps
included, and fp16 and bf16 checkpoints resume across the two systems both ways. In process:
the same training against DeepSpeed's rules written out as a plain loop, and the pieces one by one.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridtrain.deepspeed as deepspeed
from hybridtrain.config import load_config
from hybridtrain.deepspeed.building import master_weights
from hybridtrain.deepspeed.master_weights import MasterWeightsOptimizer, combined_scale, global_norm
from tests.deepspeed.frameworks import finish, record, start

RUNS = ("stage0", "stage0_fused", "stage1", "stage2")
CROSSED = ("fp16", "bf16")
"""The variants whose checkpoints cross between the two systems."""


class _Scaled(nn.Module):
    """Linear → tanh → Linear with an fp32 buffer, which DeepSpeed's cast leaves fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(6, 12), nn.Linear(12, 3)
        self.register_buffer("scale", torch.full((12,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)) * self.scale.to(x.dtype))


def _plain_deepspeed_bf16(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float,
                          clip: float, init_step: bool = True) -> list[torch.Tensor]:
    """DeepSpeed's ZeRO-0 bf16 rules as a plain loop (``FP16_UnfusedOptimizer`` over a torch
    AdamW): bfloat16 weights, fp32 masters stepped once with zero gradients when built,
    gradients summed in bfloat16 over 2 micro-batches, clipped on fp32 by
    ``(norm + 1e-6) / clip``, masters copied back. Returns the final masters. ``init_step``: False for
    the ZeRO wrappers, which take no step when built."""
    params = list(model.parameters())
    for p in params:
        p.data = p.data.bfloat16()
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    optimizer = torch.optim.AdamW(masters, lr=lr, weight_decay=0.1)
    for m in masters:
        m.grad = torch.zeros_like(m)
    if init_step:
        optimizer.step()
    for step in range(0, len(batches), 2):
        for inputs, targets in batches[step:step + 2]:
            (F.mse_loss(model(inputs.bfloat16()).float(), targets) / 2).backward()
        norm = math.sqrt(sum(float(p.grad.float().norm()) ** 2 for p in params))
        divisor = max((norm + 1e-6) / clip, 1.0)
        for p, m in zip(params, masters, strict=True):
            m.grad = p.grad.float() / divisor
            p.grad = None
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(params, masters, strict=True):
                p.copy_(m)
    return masters


def test_a_callers_optimizer_trains_with_deepspeeds_bf16_rules() -> None:
    torch.manual_seed(0)
    model = _Scaled()
    reference = _Scaled()
    reference.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 6, generator=generator), torch.randn(4, 3, generator=generator)) for _ in range(8)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.3,
              "bf16": {"enabled": True}}
    engine, returned, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    assert isinstance(returned, MasterWeightsOptimizer) and returned.rule == "unfused"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.scale.dtype == torch.float32  # buffers keep their dtype, as DeepSpeed's cast
    for inputs, targets in batches:
        engine.backward(F.mse_loss(engine(inputs.bfloat16()).float(), targets))
        engine.step()
    expected = _plain_deepspeed_bf16(reference, batches, lr=0.05, clip=0.3)
    masters = [m for group in returned.param_groups for m in group["params"]]
    for mine, theirs in zip(masters, expected, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7)
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        # the weights are the masters rounded to bfloat16: at most one bfloat16 step apart
        torch.testing.assert_close(mine.float(), theirs.float(), rtol=2.0**-8, atol=0)
    assert engine.get_global_grad_norm() == returned.last_grad_norm > 0.3  # the clip acted


@pytest.mark.parametrize("rule", ["fused", "unfused", "zero"])
def test_every_rule_measures_the_global_norm_and_clips_to_max_norm(rule: Any) -> None:
    generator = torch.Generator().manual_seed(2)
    groups = [[torch.randn(5, 3, generator=generator).bfloat16(), torch.randn(7, generator=generator).bfloat16()],
              [torch.randn(4, generator=generator).bfloat16()]]
    everything = torch.cat([g.float().reshape(-1) for group in groups for g in group])
    norm = global_norm(rule, groups)
    assert norm == pytest.approx(float(torch.linalg.vector_norm(everything.double())), rel=1e-6)
    assert float(combined_scale(rule, norm, max_norm=norm * 2)) == 1.0
    assert float(combined_scale(rule, norm, max_norm=0.0)) == 1.0  # no clipping configured
    assert float(combined_scale(rule, norm, max_norm=1.0)) == pytest.approx(norm + 1e-6, rel=1e-6)
    # fp16: the gradients (and their norm) are 2**10 times larger; one multiplication unscales and clips
    assert float(combined_scale(rule, norm * 1024, max_norm=1.0, scale=1024.0)) == pytest.approx(
        (norm + 1e-6) * 1024, rel=1e-6)
    assert float(combined_scale(rule, norm * 1024, max_norm=norm * 2, scale=1024.0)) == 1024.0


def test_a_step_with_an_infinite_gradient_is_skipped() -> None:
    weight = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    optimizer = MasterWeightsOptimizer(torch.optim.SGD([weight], lr=0.1), max_norm=1.0, rule="zero",
                                       fp16_init_step=False)
    weight.grad = torch.tensor([1.0, float("inf"), 0.0], dtype=torch.bfloat16)
    optimizer.step()
    assert optimizer.last_grad_norm == float("inf") and optimizer.last_step_skipped
    assert weight.grad is None  # dropped, as DeepSpeed's wrappers drop an overflowed step's
    assert torch.equal(weight, torch.ones(3, dtype=torch.bfloat16))
    assert torch.equal(optimizer.param_groups[0]["params"][0], torch.ones(3))


def test_fp16_side_by_side_with_the_real_deepspeed_overflows_and_resume_included(tmp_path: Path) -> None:
    """fp16 (hysteresis without and with ``consecutive_hysteresis``) and bf16, every wrapper (and
    bf16 under ZeRO-Offload, ZeRO-1/2):
    steps overflow at the start, where the scale grows back and at an infinite gradient; each
    is skipped with the LR schedule held, as on the real DeepSpeed, to the bit; and fp16
    checkpoints cross between the two systems both ways (:func:`_crossed`); ``save_16bit_model``
    writes the half dtype, as DeepSpeed's."""
    pytest.importorskip("deepspeed")  # the reference
    variants = ["fp16", "fp16-consecutive", "bf16", "bf16-offload"]
    dirs = {"real": tmp_path / "real-ckpt", "ours": tmp_path / "our-ckpt"}  # saved after 4 steps, for _fp16_crossed
    runs = [(system, start("fp16_script.py", ["through", str(dirs[system]), *variants, str(tmp_path / system)],
                           tmp_path, real=system == "real", env={"HYBRIDTRAIN_REFERENCE_FP16": "1"}))
            for system in ("real", "ours")]
    for system, process in runs:
        finish(process, f"{system} fp16_script")
    for variant in variants:
        for name in RUNS if variant != "bf16-offload" else ("stage1", "stage2"):  # ZeRO-Offload: ZeRO-1/2
            ours, our_params = record(tmp_path / f"ours.{variant}.{name}")
            real, real_params = record(tmp_path / f"real.{variant}.{name}")
            assert "+hybridtrain" in ours["deepspeed"] and "+hybridtrain" not in real["deepspeed"]
            for key in ("steps", "lrs", "scales", "skipped", "applied", "dtypes"):
                assert ours[key] == real[key], (variant, name, key, ours[key], real[key])
            assert ours["dtypes"] == ours["saved_dtypes"] == real["saved_dtypes"] == [
                f"torch.{'float16' if variant.startswith('fp16') else 'bfloat16'}"]
            assert ours["applied"].count(False) == ours["skipped"][-1] > 0
            if name == "stage0_fused":
                _assert_within_one_half_step(ours, our_params, real, real_params, variant)
                continue
            assert ours["losses"] == real["losses"], (variant, name)
            assert ours["grad_norms"] == _reported_unscaled(real, name), (variant, name)
            for key, value in real_params.items():
                assert torch.equal(our_params[key], value), (variant, name, key)
    fp16 = record(tmp_path / "ours.fp16.stage2")[0]
    assert fp16["lrs"][:5] == [0.0] * 5  # the warm-up held back through the four skipped steps
    assert fp16["scales"] != record(tmp_path / "ours.fp16-consecutive.stage2")[0]["scales"]
    for system, directory in dirs.items():  # DeepSpeed's file names, as the real one writes them
        assert {p.name for p in (directory / "bf16" / "stage0" / "global_step4").iterdir()} == {
            "mp_rank_00_model_states.pt"}, system
        assert {p.name for p in (directory / "bf16" / "stage2" / "global_step4").iterdir()} == {
            "mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"}, system
    _crossed(tmp_path, dirs)


def _crossed(tmp_path: Path, dirs: dict[str, Path]) -> None:
    """Saved after 4 steps (fp16: the scale shrunk, ZeRO's hysteresis spent) on one system (in
    ``dirs``) and resumed on the other: the last 4 steps are the uninterrupted run's, scale and
    skips included."""
    mode, where = "resume", {"real": dirs["ours"], "ours": dirs["real"]}
    runs = [start("fp16_script.py", [mode, str(where[system]), *CROSSED, str(tmp_path / f"{system}-{mode}")],
                  tmp_path, real=system == "real", env={"HYBRIDTRAIN_REFERENCE_FP16": "1"})
            for system in ("real", "ours")]
    for process in runs:
        finish(process, f"fp16_script {mode}")
    for resumed, uninterrupted in (("ours", "real"), ("real", "ours")):  # theirs resumed here, ours there
        for variant in CROSSED:
            for name in RUNS:
                mine, my_params = record(tmp_path / f"{resumed}-resume.{variant}.{name}")
                whole, whole_params = record(tmp_path / f"{uninterrupted}.{variant}.{name}")
                for key in ("lrs", "scales", "skipped", "applied", "steps"):
                    tail = whole[key][-4:] if isinstance(whole[key], list) else whole[key]
                    assert mine[key] == tail, (resumed, variant, name, key, mine[key], whole[key])
                if name != "stage0_fused":  # FusedAdam's C++ kernel rounds apart (see below)
                    for key, value in whole_params.items():
                        assert torch.equal(my_params[key], value), (resumed, variant, name, key)


def _assert_within_one_half_step(ours: dict[str, Any], our_params: dict[str, torch.Tensor], real: dict[str, Any],
                                 real_params: dict[str, torch.Tensor], variant: str) -> None:
    """ZeRO-0 over FusedAdam: the real DeepSpeed steps its masters with FusedAdam's C++ CPU
    kernel, the drop-in with torch's foreach Adam; the two round one element in about twenty
    differently by one fp32 ulp (as torch's own fused and default kernels do, #38), and such an
    ulp can carry a half weight across a rounding boundary. So: weights within one step of the
    half dtype (2**-10 relative for fp16, 2**-7 for bf16), losses and norms within a few of its
    unit roundoffs."""
    step = 2.0**-10 if variant.startswith("fp16") else 2.0**-7
    losses, norms = torch.tensor(ours["losses"]), torch.tensor(ours["grad_norms"])
    torch.testing.assert_close(losses, torch.tensor(real["losses"]), rtol=4 * step, atol=0)
    torch.testing.assert_close(norms, torch.tensor(_reported_unscaled(real, "stage0_fused")), rtol=4 * step, atol=0)
    for key, value in real_params.items():
        torch.testing.assert_close(our_params[key], value, rtol=step, atol=step * 1e-2, msg=f"{variant} {key}")


def _reported_unscaled(real: dict[str, Any], name: str) -> list[float]:
    """The real DeepSpeed's reported gradient norms as the drop-in reports them: of the
    unscaled gradients. ZeRO-1/2 report that; ``FP16_UnfusedOptimizer`` reports the scaled norm
    and ``FP16_Optimizer`` divides it by the scale after its update (twice the one used where
    the scale grew). Exact: the scales are powers of two."""
    if name not in ("stage0", "stage0_fused"):
        return list(real["grad_norms"])
    return [norm / before if name == "stage0" else norm * after / before
            for norm, (before, after) in zip(real["grad_norms"], real["scales"], strict=True)]


@pytest.mark.parametrize(("extra", "expected"), [
    ({}, True),
    ({"zero_optimization": {"stage": 2}}, True),
    ({"zero_optimization": {"stage": 3}}, True),  # ZeRO-3's own wrapper: runtime/zero/stage3_masters.py
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, True),  # ZeRO-Offload
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, True),  # its offload too
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}}, False),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, False),
    ({"data_types": {"grad_accum_dtype": "fp32"}}, False),
    ({"bf16": {"enabled": False}}, False),
])
def test_deepspeeds_bf16_math_is_chosen_where_deepspeeds_wrappers_run(extra: dict[str, Any], expected: bool) -> None:
    raw = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, **extra}
    assert master_weights(raw, load_config(dict(raw))) is expected
