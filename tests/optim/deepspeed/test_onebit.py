"""DeepSpeed's 1-bit Adam, 0/1 Adam and 1-bit LAMB on one process: hybridtrain's classes
against DeepSpeed's own (``deepspeed_onebit/``, DeepSpeed 0.19.6's python unchanged), driven
with the same gradients, bit for bit. DeepSpeed's classes only read ``size`` from their
communication backend and skip every compressed all-reduce when it is 1, so the backend and
``deepspeed.comm`` are stubbed to one process."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridtrain.optim import build_optimizer, take_fp16_init_step
from hybridtrain.optim.deepspeed.onebit_adam import OnebitAdam, ZeroOneAdam
from hybridtrain.optim.deepspeed.onebit_lamb import OnebitLamb
from tests.runtime.host_reads import HostReads

REFERENCE = Path(__file__).parent / "deepspeed_onebit"
SHAPES = [(7, 5), (5,), (3, 4, 2)]


class _OneProcessBackend:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.size = 1


def _deepspeed_class(file: str, name: str) -> type:
    comm = types.SimpleNamespace(is_initialized=lambda: True, get_rank=lambda: 0, get_world_size=lambda: 1,
                                 all_reduce=lambda tensor: tensor)
    spec = importlib.util.spec_from_file_location(f"deepspeed_onebit_{file}", REFERENCE / f"{file}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.dist = comm  # type: ignore[attr-defined]
    return getattr(module, name)  # type: ignore[no-any-return]


@pytest.fixture(autouse=True)
def _one_process_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    # DeepSpeed's constructors import their backend; only that entry of sys.modules is swapped.
    backend = types.ModuleType("deepspeed.runtime.comm.nccl")
    backend.NcclBackend = _OneProcessBackend  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, backend.__name__, backend)


def _params(groups: bool) -> tuple[list[torch.nn.Parameter], list[Any]]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    if not groups:
        return params, list(params)
    return params, [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}]


def _drive(ds_cls: type, ours_cls: type, kwargs: dict[str, Any], steps: int, init: bool, groups: bool,
           mask: bool = False) -> None:
    theirs, their_groups = _params(groups)
    ours, our_groups = _params(groups)
    if mask:  # a group of one tensor with a momentum mask, as bing_bert masks unused position rows
        for params, g in ((theirs, their_groups), (ours, our_groups)):
            g[:] = [{"params": params[:1], "exp_avg_mask": (torch.arange(35) % 3 != 0).float().view(7, 5)},
                    {"params": params[1:]}]
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")  # DeepSpeed's deprecated add_(scalar, tensor) overloads
        reference = ds_cls(their_groups, types.SimpleNamespace(mpu=None, local_rank=0), **kwargs)
        optimizer = ours_cls(our_groups, **kwargs)
        if init:  # DeepSpeed's fp16 wrapper: step() once with zero gradients when it is built
            take_fp16_init_step(reference)
            take_fp16_init_step(optimizer)
        gen = torch.Generator().manual_seed(1)
        for k in range(steps):
            grads = [torch.randn(shape, generator=gen) * (1 + k % 3) for shape in SHAPES]
            for params in (theirs, ours):
                for p, g in zip(params, grads, strict=True):
                    p.grad = g.clone()
            reference.step()
            optimizer.step()
            for a, b in zip(theirs, ours, strict=True):
                assert torch.equal(a, b), f"step {k + 1}: {(a - b).abs().max().item()}"


BASE = {"lr": 1e-2, "weight_decay": 0.01, "bias_correction": False}
CASES = [
    ("adam", "OnebitAdam", OnebitAdam, {**BASE, "freeze_step": 10}),
    ("adam", "OnebitAdam", OnebitAdam, {**BASE, "freeze_step": 1, "eps": 1e-6}),
    ("zoadam", "ZeroOneAdam", ZeroOneAdam, {**BASE, "var_freeze_step": 12, "var_update_scaler": 3,
                                            "local_step_scaler": 4, "local_step_clipper": 4}),
    ("zoadam", "ZeroOneAdam", ZeroOneAdam, {**BASE, "var_freeze_step": 0}),
    ("lamb", "OnebitLamb", OnebitLamb, {**BASE, "freeze_step": 10, "max_coeff": 0.3}),
    ("lamb", "OnebitLamb", OnebitLamb, {"lr": 2e-3, "freeze_step": 6, "weight_decay": 0.01, "max_coeff": 0.3,
                                        "factor_threshold": 0.3}),
    ("lamb", "OnebitLamb", OnebitLamb, {**BASE, "freeze_step": 1, "weight_decay": 0.0}),
]


@pytest.mark.parametrize(("file", "name", "ours", "kwargs"), CASES,
                         ids=lambda v: str(v)[:40] if isinstance(v, dict) else None)
@pytest.mark.parametrize("init", [True, False], ids=["fp16-wrapper", "fp32"])
def test_bit_for_bit_with_deepspeeds_class(file: str, name: str, ours: type, kwargs: dict[str, Any],
                                           init: bool) -> None:
    _drive(_deepspeed_class(file, name), ours, kwargs, steps=30, init=init, groups=init)


@pytest.mark.parametrize(("file", "name", "ours"), [("adam", "OnebitAdam", OnebitAdam),
                                                    ("lamb", "OnebitLamb", OnebitLamb)])
def test_momentum_mask_as_deepspeed(file: str, name: str, ours: type) -> None:
    _drive(_deepspeed_class(file, name), ours, {**BASE, "freeze_step": 4}, steps=10, init=True, groups=True,
           mask=True)


@pytest.mark.parametrize(("name", "kwargs"), [
    ("OneBitAdam", {"freeze_step": 4}),
    ("ZeroOneAdam", {"var_freeze_step": 4, "var_update_scaler": 2, "local_step_scaler": 2}),
    ("OneBitLamb", {"freeze_step": 4}),
])
def test_resume_from_state_dict_is_exact(name: str, kwargs: dict[str, Any]) -> None:
    # DeepSpeed keeps "frozen" flags on the object; here they follow from the saved step counts.
    params = {**BASE, **kwargs}

    def built(model: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        opt = build_optimizer(model, name, params)
        take_fp16_init_step(opt)  # DeepSpeed's fp16 init step: the 1-bit optimizers' buffer set-up
        return opt
    gen = torch.Generator().manual_seed(2)
    grads = [[torch.randn(shape, generator=gen) for shape in SHAPES] for _ in range(10)]

    def run(steps: range, model: list[torch.nn.Parameter], opt: torch.optim.Optimizer) -> None:
        for k in steps:
            for p, g in zip(model, grads[k], strict=True):
                p.grad = g.clone()
            opt.step()

    straight, _ = _params(False)
    run(range(10), straight, built(straight))
    first, _ = _params(False)
    opt = built(first)
    run(range(5), first, opt)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    again = build_optimizer(resumed, name, params)
    again.load_state_dict(opt.state_dict())
    run(range(5, 10), resumed, again)
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a, b)


def test_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    p = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match=r"^optimizer.params.amsgrad = True: DeepSpeed's OneBitAdam"):
        build_optimizer(p, "OneBitAdam", {"amsgrad": True})
    with pytest.raises(ValueError, match=r"^optimizer.params.comm_backend_name = 'gloo'; DeepSpeed allows nccl"):
        build_optimizer(p, "ZeroOneAdam", {"comm_backend_name": "gloo"})
    with pytest.raises(ValueError, match=r"rejected by DeepSpeed's OneBitLamb: .*'freeze_steps'"):
        build_optimizer(p, "OneBitLamb", {"freeze_steps": 3})
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"^optimizer.type = 'OneBitLamb' runs on one process here \(world size 2\)"):
        build_optimizer(p, "onebitlamb", {})


@pytest.mark.parametrize(("name", "kwargs"), [
    ("Lamb", {"weight_decay": 0.01}),
    ("OneBitAdam", {"freeze_step": 3}),
    ("ZeroOneAdam", {"var_freeze_step": 3, "var_update_scaler": 2, "local_step_scaler": 2}),
    ("OneBitLamb", {"freeze_step": 3, "weight_decay": 0.01}),
])
def test_engine_resumes_exactly_from_its_checkpoint(name: str, kwargs: dict[str, Any], tmp_path: Path) -> None:
    import hybridtrain as ht

    config = {"device": "cpu", "train_batch_size": 4, "fp16": {"enabled": True}, "gradient_clipping": 1.0,
              "optimizer": {"type": name, "params": {"lr": 1e-2, **kwargs}}}
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 4, generator=gen), torch.randn(4, 2, generator=gen)) for _ in range(8)]

    def engine() -> Any:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        return ht.initialize(model, config, loss_fn=lambda out, batch: (out - batch[1]).pow(2).mean())

    straight = engine()
    for batch in batches:
        straight.train_batch(batch)
    first = engine()
    for batch in batches[:4]:
        first.train_batch(batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        first.save_checkpoint(tmp_path)
        resumed = engine()
        resumed.load_checkpoint(tmp_path)
    for batch in batches[4:]:
        resumed.train_batch(batch)
    for a, b in zip(straight.module.parameters(), resumed.module.parameters(), strict=True):
        assert torch.equal(a, b)


def test_onebit_lamb_reads_the_device_once_per_step_not_per_tensor() -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(5)]
    opt = OnebitLamb(params, lr=1e-2, freeze_step=3, weight_decay=0.01)
    for step in range(5):  # set-up, warm-up and compressed steps
        for p in params:
            p.grad = torch.randn_like(p)
        with HostReads() as reads:
            opt.step()
        assert len(reads.calls) <= 2, (step, reads.calls)  # + once, at the first compressed step
