"""DeepSpeed's schedules give every optimizer step DeepSpeed's learning rate (and, for
OneCycle, β₁): compared against DeepSpeed's own scheduler classes
(``deepspeed.runtime.lr_schedules``) driven the way its engine drives them — ``step()``
after every optimizer step, so step ``n`` runs with the rate set after ``n`` calls."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridtrain.optim import build_optimizer, build_scheduler

CASES: list[tuple[str, dict[str, Any]]] = [
    ("WarmupLR", {}),  # every default: log warm-up over 1000 steps from 0 to the optimizer's lr
    ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 7, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_num_steps": 1}),
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 5}),
    ("WarmupDecayLR", {"total_num_steps": 12, "warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4,
                       "warmup_num_steps": 4, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 6}),
    ("WarmupCosineLR", {"total_num_steps": 15, "warmup_num_steps": 3, "warmup_min_ratio": 0.1,
                        "cos_min_ratio": 0.05, "warmup_type": "linear"}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 3, "lr_range_test_step_rate": 2.0}),
    ("LRRangeTest", {"lr_range_test_step_size": 4, "lr_range_test_staircase": True}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 5}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 4,
                  "cycle_second_step_size": 6, "cycle_first_stair_count": 2, "decay_step_size": 2,
                  "decay_lr_rate": 0.5, "decay_mom_rate": 0.1}),
]
STEPS = 40


def _rates(optimizer: torch.optim.Optimizer, scheduler: Any) -> list[tuple[float, float | None]]:
    rates = []
    for _ in range(STEPS):
        group = optimizer.param_groups[0]
        rates.append((float(group["lr"]), float(group["betas"][0]) if "betas" in group else None))
        scheduler.step()
    return rates


@pytest.mark.parametrize(("kind", "params"), CASES)
def test_every_step_has_deepspeeds_rate(kind: str, params: dict[str, Any]) -> None:
    from deepspeed.runtime import lr_schedules

    ours_opt = build_optimizer([torch.nn.Parameter(torch.ones(2))], "AdamW", {"lr": 0.05})
    ours = _rates(ours_opt, build_scheduler(ours_opt, kind, params))
    ref_opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.05)
    reference = _rates(ref_opt, getattr(lr_schedules, kind)(ref_opt, **params))
    assert [lr for lr, _ in ours] == pytest.approx([lr for lr, _ in reference], rel=1e-12, abs=0)
    assert [beta for _, beta in ours] == pytest.approx([beta for _, beta in reference], rel=1e-12, abs=0)


def test_resume_continues_the_schedule() -> None:
    params = {"total_num_steps": 20, "warmup_num_steps": 6}
    first = build_optimizer([torch.nn.Parameter(torch.ones(2))], "AdamW", {"lr": 0.05})
    straight = build_scheduler(first, "WarmupCosineLR", params)
    for _ in range(8):
        straight.step()
    second = build_optimizer([torch.nn.Parameter(torch.ones(2))], "AdamW", {"lr": 0.05})
    resumed = build_scheduler(second, "WarmupCosineLR", params)
    resumed.load_state_dict(straight.state_dict())
    assert second.param_groups[0]["lr"] == first.param_groups[0]["lr"]


@pytest.mark.parametrize(("kind", "params", "needle"), [
    ("WarmupDecayLR", {"warmup_num_steps": 5}, "total_num_steps is required"),
    ("WarmupLR", {"warmup_num_step": 5}, r"\['warmup_num_step'\] are not parameters of DeepSpeed's WarmupLR"),
    ("WarmupLR", {"warmup_type": "exp"}, "warmup_type = 'exp'"),
    ("OneCycle", {"cycle_max_lr": 0.1}, "cycle_min_lr is required"),
])
def test_bad_parameters_are_one_line(kind: str, params: dict[str, Any], needle: str) -> None:
    opt = build_optimizer([torch.nn.Parameter(torch.ones(2))], "AdamW", {"lr": 0.05})
    with pytest.raises(ValueError, match=needle):
        build_scheduler(opt, kind, params)
