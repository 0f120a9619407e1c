"""SavedTensorMeter counts exactly what autograd keeps for backward."""

from __future__ import annotations

import torch

from hybridtrain.profiling import SavedTensorMeter


def test_counts_saved_tensors() -> None:
    w = torch.randn(8, 4, requires_grad=True)
    x = torch.randn(16, 8)
    with SavedTensorMeter() as meter:
        (x @ w).sum()  # matmul saves x (16×8 floats) for w's gradient
    assert meter.tensors >= 1 and meter.bytes >= 16 * 8 * 4
    with SavedTensorMeter() as idle, torch.no_grad():
        x @ w
    assert idle.bytes == 0
