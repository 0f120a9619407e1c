"""The host step off the critical path when it must wait for every gradient (clipping,
fp16): gradient norms taken as buckets land, the clip folded into each bucket's update,
and (``engine.overlap_updates``) the streamed blocks updated while the next forward starts.
Equivalence with the plain loop under these settings is in the shared suite (modes with
``overlap_updates`` and clipping); here: that the overlap happens, that the results are
the same bits as without it, and that nothing reads a half-updated block."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

import hybridtrain as ht
from hybridtrain.runtime.offload.bucket import Bucket
from hybridtrain.runtime.offload.optimizer import OffloadOptimizer
from tests.equivalence import (
    MODES,
    SEED,
    Mode,
    assert_resume_exact,
    engine_config,
    gpt_case,
    plain_run,
)

CASE = gpt_case()
OFFLOAD_CLIP = {"gradient_clipping": 0.05, "zero_optimization": {
    "stage": 1, "reduce_bucket_size": 2000, "offload_optimizer": {"device": "cpu"}}}
STREAM_CLIP = {"gradient_clipping": 0.05, "layer_streaming": {"enabled": True}}
LAYER_MAJOR_CLIP = {"gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
                    "layer_streaming": {"enabled": True, "layer_major": True}}
STEPS = 3


def _engine(config: dict[str, Any], overlap: bool) -> ht.Engine:
    torch.manual_seed(SEED)
    engine = ht.initialize(CASE.build(), engine_config(MODES["plain"], **config), loss_fn=CASE.loss_fn)
    engine.overlap_updates = overlap
    return engine


def _train(engine: ht.Engine, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(SEED + 1)
    losses = [engine.train_batch(batch) for batch in CASE.batches(steps)]
    return losses, engine.model_state_dict()


def _last_updated(engine: ht.Engine) -> Bucket:
    """The bucket whose background update runs last (the model's last parameters)."""
    opt = engine.optimizer
    assert isinstance(opt, OffloadOptimizer)
    return max((b for b in opt.buckets if b.optimizer is not None), key=lambda b: min(
        i for i, p in enumerate(engine.module.parameters()) for q in b.params if p is q))


def _slow_last_update(engine: ht.Engine, seconds: float) -> tuple[list[float], list[float]]:
    """Make the last host update of a step take ``seconds`` longer; return the lists its
    end times and block 0's forward start times are appended to."""
    last = _last_updated(engine)
    assert last.optimizer is not None
    inner, step = last.optimizer, last.optimizer.step
    update_ends: list[float] = []
    forward_starts: list[float] = []

    def slow_step(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        out = step(*args, **kwargs)
        update_ends.append(time.perf_counter())
        return out

    inner.step = slow_step  # type: ignore[method-assign]
    first_block = engine.module.get_submodule("blocks.0")
    first_block.register_forward_pre_hook(lambda *_: forward_starts.append(time.perf_counter()))
    return update_ends, forward_starts


@pytest.mark.parametrize("config", [OFFLOAD_CLIP, STREAM_CLIP, LAYER_MAJOR_CLIP],
                         ids=["optimizer_offload", "streaming", "layer_major_streaming"])
def test_the_next_forward_starts_while_the_last_block_still_updates(config: dict[str, Any]) -> None:
    engine = _engine(config, overlap=True)
    update_ends, forward_starts = _slow_last_update(engine, 0.3)
    batches = CASE.batches(2)
    engine.train_batch(batches[0])
    returned = time.perf_counter()
    engine.train_batch(batches[1])
    engine.wait_for_updates()
    # Step 1's update of the last block ended after step 1 returned and after step 2's
    # forward had entered block 0: the host update overlapped the next forward.
    assert update_ends[0] > returned
    second_forward = [t for t in forward_starts if t > returned][0]
    assert second_forward < update_ends[0]


@pytest.mark.parametrize("config", [OFFLOAD_CLIP, STREAM_CLIP, LAYER_MAJOR_CLIP],
                         ids=["optimizer_offload", "streaming", "layer_major_streaming"])
def test_overlapped_updates_give_the_same_bits_as_waiting_for_them(config: dict[str, Any]) -> None:
    waiting = _engine(config, overlap=False)
    waited = _train(waiting)
    overlapping = _engine(config, overlap=True)
    _slow_last_update(overlapping, 0.05)  # the next forward surely starts first
    overlapped = _train(overlapping)
    assert waited[0] == overlapped[0]
    for name, value in waited[1].items():
        assert torch.equal(value, overlapped[1][name]), name
    # Right after a step, the model's state dict is read once every update is done,
    # evaluation uploads each block once its update is, and so on for the optimizer's state.
    batch = CASE.batches(STEPS + 1)[-1]
    waiting.train_batch(batch)
    overlapping.train_batch(batch)
    # The model's own state_dict (Hugging Face's save_pretrained) waits for the updates.
    mine, reference = overlapping.module.state_dict(), waiting.module.state_dict()
    assert all(torch.equal(mine[k].cpu(), v.cpu()) for k, v in reference.items())
    assert overlapping.eval_batch(batch) == waiting.eval_batch(batch)
    theirs, ours = waiting.optimizer.state_dict()["state"], overlapping.optimizer.state_dict()["state"]
    assert theirs.keys() == ours.keys()
    for key, entry in theirs.items():
        for name, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(ours[key][name])), (key, name)


def test_clipping_on_the_host_is_torchs_clipping_bit_for_bit() -> None:
    # fp32, the fused CPU AdamW the host steps with in the reference too (plain_run takes
    # the engine's kernel): the only difference left is where the norm and the clip factor are computed.
    mode = Mode("offload_clip", {"gradient_clipping": 0.05, "zero_optimization": {
        "stage": 1, "reduce_bucket_size": 2000, "offload_optimizer": {"device": "cpu"}}}, clip=0.05)
    expected = plain_run(CASE, mode, steps=STEPS)
    engine = _engine(mode.config, overlap=False)
    opt = engine.optimizer
    assert isinstance(opt, OffloadOptimizer) and opt.grad_norms
    norms = []
    torch.manual_seed(SEED + 1)
    losses = []
    for batch in CASE.batches(STEPS):
        losses.append(engine.train_batch(batch))
        assert engine.last_grad_norm is not None
        norms.append(float(engine.last_grad_norm))
    assert losses == expected[0]
    for name, value in engine.model_state_dict().items():
        assert torch.equal(value, expected[1][name]), name
    assert all(n > 0.05 for n in norms)  # the clip clipped


def test_resume_is_exact_with_overlapped_updates(tmp_path) -> None:
    def make() -> ht.Engine:
        return _engine(STREAM_CLIP, overlap=True)

    torch.manual_seed(SEED + 1)
    assert_resume_exact(make, CASE.batches(4), tmp_path / "ckpt")


def test_a_failed_background_update_is_raised_by_the_next_step_not_hung_on() -> None:
    engine = _engine(STREAM_CLIP, overlap=True)
    last = _last_updated(engine)
    assert last.optimizer is not None

    def broken(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("host update failed")

    last.optimizer.step = broken  # type: ignore[method-assign]
    batches = CASE.batches(2)
    engine.train_batch(batches[0])
    done = threading.Event()
    errors: list[BaseException] = []

    def second() -> None:
        try:
            engine.train_batch(batches[1])
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            errors.append(exc)
        done.set()

    threading.Thread(target=second, daemon=True).start()
    assert done.wait(60), "the step after a failed background update hung"
    assert errors and "host update failed" in str(errors[0])
    # The step's result is lost: every later step and save says so instead of training on.
    for _ in range(2):
        with pytest.raises(RuntimeError, match="host update failed"):
            engine.train_batch(batches[1])
    with pytest.raises(RuntimeError, match="host update failed"):
        engine.optimizer.state_dict()


def test_a_weight_read_outside_its_module_waits_for_its_update() -> None:
    """The loss reads the final norm's weight itself (a penalty), before any module that
    owns it runs again: the read waits for that weight's background update, and training
    gives the bits it gives without overlap."""
    def penalised(out: Any, batch: Any, model: torch.nn.Module) -> torch.Tensor:
        return CASE.loss_fn(out, batch) + 1e-3 * model.get_submodule("ln_f").weight.pow(2).sum()

    def run(overlap: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        torch.manual_seed(SEED)
        model = CASE.build()
        engine = ht.initialize(model, engine_config(MODES["plain"], **OFFLOAD_CLIP),
                               loss_fn=lambda out, batch: penalised(out, batch, model))
        engine.overlap_updates = overlap
        norm = engine.module.get_submodule("ln_f").weight
        opt = engine.optimizer
        assert isinstance(opt, OffloadOptimizer)
        [bucket] = [b for b in opt.buckets if any(p is norm for p in b.params)]
        assert bucket.optimizer is not None
        step = bucket.optimizer.step

        def slow_step(*args: Any, **kwargs: Any) -> Any:
            time.sleep(0.2)  # still updating when the next step's forward starts
            return step(*args, **kwargs)

        bucket.optimizer.step = slow_step  # type: ignore[method-assign]
        return _train(engine)

    waited, overlapped = run(False), run(True)
    assert waited[0] == overlapped[0]
    for name, value in waited[1].items():
        assert torch.equal(value, overlapped[1][name]), name


def test_overlapped_updates_under_a_schedule_take_their_own_steps_lr() -> None:
    """The scheduler moves on right after step() returns: each background update must use
    the hyperparameters of the step that queued it."""
    schedule = {**OFFLOAD_CLIP, "scheduler": {"type": "cosine", "params": {
        "warmup_num_steps": 2, "total_num_steps": 6, "cos_min_ratio": 0.1}}}
    waited = _train(_engine(schedule, overlap=False))
    overlapping = _engine(schedule, overlap=True)
    _slow_last_update(overlapping, 0.05)
    overlapped = _train(overlapping)
    assert waited[0] == overlapped[0]
    for name, value in waited[1].items():
        assert torch.equal(value, overlapped[1][name]), name


def _tensor_lr_run(background: bool) -> torch.Tensor:
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    adam = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.1))  # a tensor lr, as torch allows
    opt = OffloadOptimizer(adam, torch.device("cpu"), pin_memory=False, defer=True)
    opt.background = opt.background_resident = background
    for bucket in opt.buckets:  # each update takes a while: the scheduler moves on first
        assert bucket.optimizer is not None
        real = bucket.optimizer.step
        bucket.optimizer.step = lambda *a, real=real, **k: (time.sleep(0.2), real(*a, **k))[1]  # type: ignore[method-assign]
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0 if step >= 1 else 1.0)
    opt.zero_grad()
    loss = model(torch.ones(2, 8)).square().sum()
    opt.before_backward(True, loss)
    loss.backward()
    opt.after_backward(True)
    opt.step()
    scheduler.step()  # writes the next step's lr (0) into the tensor in place
    opt.wait_for_updates()
    return model.weight.detach().clone()


def test_a_background_update_uses_its_own_steps_tensor_lr() -> None:
    assert torch.equal(_tensor_lr_run(background=False), _tensor_lr_run(background=True))


def test_clipping_norms_are_taken_on_the_host_worker_as_buckets_land(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the total's norm is taken on the calling thread; every gradient's norm was
    taken on the host worker as its bucket landed."""
    engine = _engine(OFFLOAD_CLIP, overlap=False)
    opt = engine.optimizer
    assert isinstance(opt, OffloadOptimizer)
    on_caller: list[int] = []
    real_norm = torch.linalg.vector_norm

    def counting_norm(*args: Any, **kwargs: Any) -> torch.Tensor:
        if threading.current_thread() is threading.main_thread():
            on_caller.append(1)
        return real_norm(*args, **kwargs)

    monkeypatch.setattr(torch.linalg, "vector_norm", counting_norm)
    engine.train_batch(CASE.batches(1)[0])
    assert len(on_caller) == 1


def test_close_lets_running_updates_finish_first() -> None:
    engine = _engine(OFFLOAD_CLIP, overlap=True)
    update_ends, _ = _slow_last_update(engine, 0.2)
    engine.train_batch(CASE.batches(1)[0])
    assert not update_ends  # still running
    opt = engine.optimizer
    assert isinstance(opt, OffloadOptimizer)
    opt.close()
    assert len(update_ends) == 1
