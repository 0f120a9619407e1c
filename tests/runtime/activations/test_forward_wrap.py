"""In-place forward wrapping: names unchanged, idempotent, reversible."""

from __future__ import annotations

import torch
from torch import nn

from hybridtrain.runtime.activations.forward_wrap import unwrap_forward, wrap_forward


def test_wrap_is_idempotent_keeps_names_and_unwraps() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    names = [n for n, _ in model.named_parameters()]
    calls: list[int] = []

    def doubled(forward, x):  # type: ignore[no-untyped-def]
        calls.append(1)
        return 2 * forward(x)

    x = torch.ones(1, 2)
    plain = model(x)
    assert wrap_forward(model[0], "_marker", doubled)
    assert not wrap_forward(model[0], "_marker", doubled)  # a second wrap changes nothing
    torch.testing.assert_close(model(x), 2 * plain)
    assert calls == [1] and [n for n, _ in model.named_parameters()] == names
    unwrap_forward(model[0], "_marker")
    torch.testing.assert_close(model(x), plain)
    assert not hasattr(model[0], "_marker")
