"""The step runner protocol: the default micro-batch loop, observers in order, and timings
that name what they measured."""

from __future__ import annotations

from contextlib import nullcontext

import torch

import hybridtrain as ht
from hybridtrain.runtime.step_runner import (
    MicroBatchRunner,
    StepContext,
    notify_after,
    notify_before,
)
from tests.equivalence import gpt_case


def test_micro_batch_loop_syncs_gradients_once_and_weights_losses() -> None:
    syncs: list[bool] = []
    backwards: list[tuple[float, bool]] = []
    step = StepContext(loss_of=lambda micro: torch.tensor(float(micro)),
                       backward=lambda loss, final: backwards.append((float(loss), final)),
                       weight=0.25, scale=1.0, timed=lambda _part: nullcontext())
    total = MicroBatchRunner(syncs.append).forward_backward([1, 2, 3, 4], step)
    assert syncs == [False, False, False, True]
    assert backwards == [(0.25, False), (0.5, False), (0.75, False), (1.0, True)]
    assert float(total) == 2.5


def test_observers_are_told_in_list_order() -> None:
    calls: list[str] = []

    class Observer:
        def __init__(self, name: str) -> None:
            self.name = name

        def before_backward(self, final: bool, loss: torch.Tensor) -> None:
            calls.append(f"before {self.name} {final}")

        def after_backward(self, final: bool) -> None:
            calls.append(f"after {self.name} {final}")

    observers = [Observer("a"), Observer("b")]
    notify_before(observers, True, torch.zeros(()))
    notify_after(observers, True)
    assert calls == ["before a True", "before b True", "after a True", "after b True"]


def test_timings_name_what_they_measured() -> None:
    case = gpt_case()
    batch = case.batches(1)[0]
    plain = ht.initialize(case.build(), {"device": "cpu", "wall_clock_breakdown": True,
                                         "gradient_accumulation_steps": 2}, loss_fn=case.loss_fn)
    plain.train_batch(batch)
    assert plain.last_timings.forward > 0 and plain.last_timings.backward > 0
    assert plain.last_timings.interleaved == 0
    layer_major = ht.initialize(case.build(), {
        "device": "cpu", "wall_clock_breakdown": True, "gradient_accumulation_steps": 2,
        "layer_streaming": {"enabled": True, "layer_major": True}}, loss_fn=case.loss_fn)
    layer_major.train_batch(batch)
    t = layer_major.last_timings
    assert t.interleaved > 0 and t.forward == 0 and t.backward == 0 and t.total >= t.interleaved
