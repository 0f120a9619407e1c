"""The engine's step-optimizer protocol: the plain default does what the plain loop does,
and the engine drives whatever optimizer it holds through the protocol, never asking
which class it is."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from hybridtrain.runtime.precision import LossScaler
from hybridtrain.runtime.step_optimizer import PlainSteps

ENGINE = Path(__file__).resolve().parents[2] / "hybridtrain" / "engine.py"


def _params_with_grads(scale: float) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    for p in params:
        p.grad = torch.randn_like(p) * scale
    return params


def test_plain_steps_unscale_and_clip_as_the_plain_loop() -> None:
    scale = 2.0 ** 4
    params, reference = _params_with_grads(scale), _params_with_grads(scale)
    steps = PlainSteps()
    assert steps.unscale_and_check(LossScaler(initial_scale_power=4), params) is True
    for p in reference:
        assert p.grad is not None
        p.grad.div_(scale)
    norm = steps.clip_grad_norm(params, 0.5, lambda ps, max_norm: torch.nn.utils.clip_grad_norm_(ps, max_norm))
    expected = torch.nn.utils.clip_grad_norm_(reference, 0.5)
    torch.testing.assert_close(norm, expected, rtol=1e-5, atol=0)
    for p, q in zip(params, reference, strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=0)


def test_plain_steps_find_a_non_finite_gradient() -> None:
    params = _params_with_grads(1.0)
    assert params[1].grad is not None
    params[1].grad[0] = float("inf")
    assert PlainSteps().unscale_and_check(LossScaler(initial_scale_power=0), params) is False


def test_the_engine_asks_no_isinstance_of_its_optimizer() -> None:
    tree = ast.parse(ENGINE.read_text())
    asked = [ast.unparse(node) for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
             and "optimizer" in ast.unparse(node.args[0])]
    assert asked == []
    assert "OffloadOptimizer" not in ENGINE.read_text()
