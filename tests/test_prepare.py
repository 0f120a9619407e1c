"""The one road from a config to an engine (:func:`hybridtrain.prepare.prepare`): every
caller builds through it, so ``"auto": true`` means the same everywhere."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import hybridtrain as ht
from hybridtrain.config import Config
from hybridtrain.models.gpt import build_gpt, causal_lm_loss
from hybridtrain.planner import Target, estimate
from hybridtrain.recovery.oom import initialize_guarded

TINY = {"model": {"name": "gpt-tiny"}, "data": {"seq_len": 32}, "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 4, "device": "cpu", "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
PACKAGE = Path(__file__).resolve().parents[1] / "hybridtrain"


def _model(_: Config | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_gpt("gpt-tiny", seq_len=32)


def test_initialize_guarded_honours_auto_as_initialize_does() -> None:
    # A limit the config as it is does not fit: the planner must choose another variant.
    limit = int(estimate(TINY, Target("cpu", "cpu")).device_peak_bytes * 0.8)
    config = {**TINY, "auto": True, "device_memory_limit": limit}
    torch.manual_seed(1)
    batch = (torch.randint(0, 256, (4, 32)), torch.randint(0, 256, (4, 32)))
    guard = initialize_guarded(_model, config, causal_lm_loss, example_batch=batch)
    chosen = guard.config  # before: the config as given, "auto" ignored and the limit not met
    as_given = Config.model_validate({**config, "auto": False})
    assert not chosen.auto and chosen != as_given
    assert estimate(chosen, Target("cpu", "cpu")).device_peak_bytes <= limit
    with guard:
        guarded = [guard.train_batch(batch) for _ in range(2)]
    # The same plan built by initialize (no limit: initialize refuses a CPU limit) trains alike.
    engine = ht.initialize(_model(), chosen.model_copy(update={"device_memory_limit": None}), causal_lm_loss,
                           example_batch=batch)
    plain = [engine.train_batch(batch) for _ in range(2)]
    torch.testing.assert_close(guarded, plain, rtol=1e-5, atol=0)


def test_only_the_one_road_builds_an_engine() -> None:
    builders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "hybridtrain.plan.build" and any(
                    alias.name == "build" for alias in node.names):
                builders.append(path.relative_to(PACKAGE).as_posix())
    assert builders == ["prepare.py"]
