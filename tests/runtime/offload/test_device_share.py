"""The device share (Twin-Flow) stepped in bounded runs (``runtime/offload/device_share.py``):
the same bits as one foreach AdamW over the whole share, with temporaries of one run's size."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import hybridtrain as ht
from hybridtrain.runtime.memory_limit import LiveTensorBytes
from hybridtrain.runtime.offload import layout
from hybridtrain.runtime.offload.device_share import DeviceShareUpdate
from hybridtrain.runtime.offload.optimizer import OffloadOptimizer
from tests.equivalence import (
    SEED,
    TWIN_FLOW_STREAMING_MODES,
    assert_same_training,
    engine_config,
    gpt_case,
    plain_run,
    train_recording_norms,
)

# A share of six tensors in two groups; runs of at most 300 elements hold one to three of them.
SHAPES = [(8, 16), (16,), (16, 16), (16,), (20, 16), (20,)]
RUN_NUMEL = 300
FOREACH_ADAMW = functools.partial(torch.optim.AdamW, foreach=True)


def _params(seed: int) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def _optimizer(params: list[nn.Parameter], one_group: bool = False) -> torch.optim.AdamW:
    if one_group:  # torch's foreach kernels step each group on its own: one group is the whole share
        return FOREACH_ADAMW(params, lr=1e-2)
    return FOREACH_ADAMW([{"params": params[:3], "weight_decay": 0.1},
                          {"params": params[3:], "lr": 3e-3, "weight_decay": 0.0}], lr=1e-2)


def _set_grads(params: list[nn.Parameter], step: int) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator) * 10.0 ** (step % 3 - 1)


def test_runs_step_the_same_bits_as_one_foreach_update_over_the_share() -> None:
    whole_params, run_params = _params(0), _params(0)
    whole = _optimizer(whole_params)
    outer = _optimizer(run_params)
    group_index = {id(p): k for k, g in enumerate(outer.param_groups) for p in g["params"]}
    runs = DeviceShareUpdate(FOREACH_ADAMW, outer, run_params, group_index, numel=RUN_NUMEL)
    assert [sum(p.numel() for p in r.param_groups[0]["params"]) for r in runs.runs[:1]] == [8 * 16 + 16]
    assert len(runs.runs) == 4  # 144 | 256 + 16 | 320 (one larger tensor alone) | 20
    for step in range(4):
        _set_grads(whole_params, step)
        _set_grads(run_params, step)
        for p, q in zip(whole_params, run_params, strict=True):  # clipping that clips: the same factor
            p.grad.mul_(0.37)
            q.grad.mul_(0.37)
        if step == 2:  # a scheduler moves the learning rate: the runs follow the outer groups
            for optimizer in (whole, outer):
                optimizer.param_groups[0]["lr"] = 5e-3
        whole.step()
        runs.step()
    for p, q in zip(whole_params, run_params, strict=True):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(whole.state[p][key], outer.state[q][key])


def _step_peak(params: list[nn.Parameter], step: DeviceShareUpdate | torch.optim.Optimizer) -> int:
    """Bytes the update adds over the tensors alive before it (parameters, gradients, state)."""
    with LiveTensorBytes("cpu", held=lambda: [t for p in params for t in (p, p.grad)]) as live:
        start = live.current_bytes
        step.step()
    return live.peak_bytes - start


def test_a_runs_temporaries_are_bounded_by_its_size_not_the_shares() -> None:
    whole_params, run_params = _params(1), _params(1)
    whole = _optimizer(whole_params, one_group=True)
    outer = _optimizer(run_params, one_group=True)
    runs = DeviceShareUpdate(FOREACH_ADAMW, outer, run_params, {id(p): 0 for p in run_params}, numel=RUN_NUMEL)
    for optimizer in (whole, runs):  # the first step makes the state; the second is the steady one
        params = whole_params if optimizer is whole else run_params
        _set_grads(params, 0)
        optimizer.step()
    _set_grads(whole_params, 1)
    _set_grads(run_params, 1)
    share_bytes = 4 * sum(p.numel() for p in whole_params)
    largest_run = 4 * max(sum(p.numel() for g in r.param_groups for p in g["params"]) for r in runs.runs)
    whole_extra, runs_extra = _step_peak(whole_params, whole), _step_peak(run_params, runs)
    assert whole_extra == share_bytes  # foreach: a temporary of the whole share
    assert runs_extra == largest_run  # one run's square root at a time


@pytest.mark.parametrize("mode", ["stream_twinflow_fp16_overflow_accum2_clip_held_later",
                                  "stream_host_twinflow_keep1_bf16_clip_held_per_upload"])
def test_the_engine_with_a_share_in_small_runs_trains_as_the_plain_loop(mode: str, monkeypatch) -> None:
    """Runs of 64 elements (the reference GPT's share is a few thousand) with held gradients
    landing after the step: the plain loop's result, clipping that clips, an overflow that skips."""
    monkeypatch.setattr(layout, "DEVICE_SHARE_GROUP_NUMEL", 64)
    case, m = gpt_case(), TWIN_FLOW_STREAMING_MODES[mode]
    torch.manual_seed(SEED)
    engine = ht.initialize(case.build(), engine_config(m), loss_fn=case.loss_fn)
    engine.overlap_updates = True
    optimizer = engine.optimizer
    assert isinstance(optimizer, OffloadOptimizer) and isinstance(optimizer._device_optimizer, DeviceShareUpdate)
    assert len(optimizer._device_optimizer.runs) > 2
    losses, norms = train_recording_norms(engine, case)
    assert_same_training(plain_run(case, m), (losses, engine.model_state_dict()), rtol=m.rtol, atol=m.atol)
    assert max(float(n) for n in norms if n is not None) > m.clip  # clipping clipped
    assert (engine.skipped_steps > 0) == ("overflow" in mode)


@pytest.mark.parametrize("share", ["last", "first"])
def test_the_device_share_is_the_first_or_the_last_parameters_as_configured(share: str) -> None:
    """``offload_optimizer.device_share`` places Twin-Flow's share: the engine's offloading
    optimizer steps on the device exactly the parameters :func:`layout.device_kept` names, at
    least ``1 - ratio`` of the elements, all before (first) or after (last) every host one."""
    torch.manual_seed(SEED)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
    engine = ht.initialize(model, {"device": "cpu", "train_micro_batch_size_per_gpu": 2, "zero_optimization": {
        "stage": 1, "offload_optimizer": {"device": "cpu", "ratio": 0.5, "device_share": share}}},
        loss_fn=lambda out, batch: out.pow(2).mean())
    optimizer = engine.optimizer
    assert isinstance(optimizer, OffloadOptimizer)
    params = list(model.parameters())
    host_updated = {id(p) for bucket in optimizer.buckets for p in bucket.params}
    on_device = {id(p) for p in params if id(p) not in host_updated}
    assert on_device == layout.device_kept(params, 0.5, set(), first=share == "first")
    assert sum(p.numel() for p in params if id(p) in on_device) >= 0.5 * sum(p.numel() for p in params)
    positions = [i for i, p in enumerate(params) if id(p) in on_device]
    host = [i for i, p in enumerate(params) if id(p) not in on_device]
    assert host and (max(positions) < min(host) if share == "first" else min(positions) > max(host))
