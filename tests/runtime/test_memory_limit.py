"""Live tensor bytes: exact per-storage counts of a training step, the limit."""

from __future__ import annotations

import gc

import pytest
import torch

from hybridtrain.runtime.memory_limit import (
    DeviceMemoryLimitError,
    LiveTensorBytes,
    tensors_alive,
)

F32 = 4
# Linear(8, 16) -> ReLU -> Linear(16, 4), batch 3
PARAMS = (8 * 16 + 16 + 16 * 4 + 4) * F32           # 848
BATCH = (3 * 8 + 3 * 4) * F32                        # x and y: 144
HIDDEN = 3 * 16 * F32                                # 192: one (3, 16) activation
OUT = 3 * 4 * F32                                    # 48: the (3, 4) output
# CPU mse_loss returns a 0-dim view of the (3, 4) buffer it reduced: its storage is 48 bytes
LOSS = 3 * 4 * F32
ADAM_STATE = 2 * PARAMS + 4 * F32                    # exp_avg, exp_avg_sq, a float32 step per param


def _others() -> list[torch.Tensor]:
    """Tensors the process held before a test (module constants, other tests' results): not counted."""
    gc.collect()
    return tensors_alive()


def _mlp_step_case() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    # single-tensor Adam: its temporaries are one parameter's sqrt and div at a time
    optimizer = torch.optim.Adam(model.parameters(), foreach=False)
    return model, optimizer, torch.randn(3, 8), torch.randn(3, 4)


def test_an_mlp_step_counts_params_grads_adam_state_activations_and_temporaries_exactly() -> None:
    others = _others()
    model, optimizer, x, y = _mlp_step_case()
    with LiveTensorBytes(ignore=others) as live:
        assert live.current_bytes == PARAMS + BATCH == 992
        loss = torch.nn.functional.mse_loss(model(x), y)
        # forward: addmm (3, 16) and relu (3, 16) both live until the addmm output dies (ReLU
        # saves only its output); then the second addmm and the loss
        assert live.peak_bytes == PARAMS + BATCH + 2 * HIDDEN == 1376
        assert live.current_bytes == PARAMS + BATCH + HIDDEN + OUT + LOSS == 1280
        loss.backward()
        # backward leaves the gradients (same sizes as the parameters) and frees the activations
        assert live.current_bytes == PARAMS + BATCH + PARAMS + LOSS == 1888
        live.reset_peak()
        optimizer.step()
        steady = PARAMS + BATCH + PARAMS + LOSS + ADAM_STATE
        assert live.current_bytes == steady == 3600
        # the largest parameter (16 x 8 weight) needs exp_avg_sq.sqrt() and its division by the
        # bias correction at once: two temporaries of 512 bytes on top of everything else
        assert live.peak_bytes == steady + 2 * 16 * 8 * F32 == 4624
        del loss
        optimizer.zero_grad()
        assert live.current_bytes == PARAMS + BATCH + ADAM_STATE == 2704


def test_views_share_one_storage_and_a_storage_counts_once() -> None:
    with LiveTensorBytes(ignore=_others()) as live:
        base = torch.zeros(10, 10)
        views = [base.t(), base[2:], base.view(100), base.unsqueeze(0), *torch.split(base, 3)]
        assert live.current_bytes == 400 and live.peak_bytes == 400
        del base
        assert live.current_bytes == 400  # the views keep the storage alive
        views.clear()
        assert live.current_bytes == 0


def test_gradients_held_only_by_autograd_at_enter_count() -> None:
    layer = torch.nn.Linear(32, 32, bias=False)
    layer(torch.randn(2, 32)).sum().backward()  # the .grad has no Python object yet
    with LiveTensorBytes() as live:
        before = live.current_bytes
        layer.weight.grad = None
        assert before - live.current_bytes == 32 * 32 * F32


def test_other_devices_do_not_count_and_resizes_do() -> None:
    with LiveTensorBytes(ignore=_others()) as live:
        torch.empty(1 << 20, device="meta")
        assert live.current_bytes == 0
        kept = torch.empty(4)
        kept.resize_(16)  # the same storage grows in place
        assert live.current_bytes == 64
        assert live.peak_bytes == 64


def test_the_limit_refuses_the_allocation_that_would_pass_it_in_one_line() -> None:
    others = _others()
    model, optimizer, x, y = _mlp_step_case()
    with LiveTensorBytes(limit_bytes=4623, ignore=others) as live:  # one byte under the step's peak
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        with pytest.raises(torch.OutOfMemoryError) as caught:
            optimizer.step()
        error = caught.value
        assert isinstance(error, DeviceMemoryLimitError)
        assert (error.needed_bytes, error.limit_bytes, live.refused_bytes) == (4624, 4623, 4624)
        message = str(error)
        assert "\n" not in message and "4624 bytes" in message and "4623 bytes" in message
        assert "aten.div" in message
        del caught, error
        assert live.peak_bytes <= 4623
    del model, optimizer, x, y, loss
    others = _others()
    model, optimizer, x, y = _mlp_step_case()
    with LiveTensorBytes(limit_bytes=4624, ignore=others) as live:  # exactly the peak fits
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    assert live.peak_bytes == 4624


def test_an_out_of_memory_error_in_backward_reaches_the_caller() -> None:
    others = _others()
    model, _, x, y = _mlp_step_case()
    with LiveTensorBytes(limit_bytes=PARAMS + BATCH + 2 * HIDDEN, ignore=others) as live:
        loss = torch.nn.functional.mse_loss(model(x), y)
        with pytest.raises(torch.OutOfMemoryError, match="on cpu needs .* more with"):
            loss.backward()
        assert live.refused_bytes is not None and live.refused_bytes > live.limit_bytes  # type: ignore[operator]


def test_timeline_records_every_change_in_time_order() -> None:
    with LiveTensorBytes(record_timeline=True, ignore=_others()) as live:
        a = torch.ones(8)
        b = a * 2
        del a, b
    bytes_seen = [count for _, count in live.timeline]
    assert bytes_seen == [0, 32, 64, 32, 0]
    times = [t for t, _ in live.timeline]
    assert times == sorted(times)


def test_ignored_storages_and_host_work_do_not_count() -> None:
    data = torch.zeros(256)
    with LiveTensorBytes(ignore=[*_others(), data[:1]]) as live:  # any view names the storage
        assert live.current_bytes == 0
        (data + 1).sum()
        assert live.peak_bytes == 256 * 4 + 4  # the sum's temporary and result; the data set is not counted
        live.counting = False
        saved = torch.ones(64)  # e.g. a checkpoint's copy
        live.counting = True
        assert live.current_bytes == 0
        del saved
        assert live.current_bytes == 0


def test_counting_stops_at_exit() -> None:
    with LiveTensorBytes(ignore=_others()) as live:
        kept = torch.ones(8)
    del kept
    torch.ones(8)
    assert live.current_bytes == 32
