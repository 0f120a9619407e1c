"""Batch shapes: splitting, devices, model calls and loss discovery."""

from __future__ import annotations

import pytest
import torch

from hybridtrain.runtime.batch import batch_size, compute_loss, run_model, split_batch


def test_split_tuple_dict_tensor() -> None:
    x, y = torch.arange(8).view(8, 1), torch.arange(8)
    parts = split_batch((x, y), 4)
    assert len(parts) == 4 and torch.equal(parts[1][0], x[2:4]) and torch.equal(parts[3][1], y[6:])
    d = split_batch({"input_ids": x, "scale": torch.tensor(2.0), "name": "n"}, 2)
    assert torch.equal(d[1]["input_ids"], x[4:]) and d[1]["name"] == "n" and d[1]["scale"].item() == 2.0
    assert [t.shape[0] for t in split_batch(x, 8)] == [1] * 8
    assert batch_size({"meta": "m", "ids": x}) == 8


def test_indivisible_and_empty_batches() -> None:
    with pytest.raises(ValueError, match="gradient_accumulation_steps=3"):
        split_batch(torch.zeros(8, 2), 3)
    with pytest.raises(TypeError, match="holds no tensor"):
        batch_size({"a": 1})


def test_loss_discovery() -> None:
    class Out:
        loss = torch.tensor(1.5)

    assert compute_loss(Out(), None, None).item() == 1.5
    assert compute_loss(torch.tensor(2.0), None, None).item() == 2.0
    assert compute_loss({"loss": torch.tensor(3.0)}, None, None).item() == 3.0
    assert compute_loss(torch.ones(3), None, lambda out, b: out.sum()).item() == 3.0
    with pytest.raises(TypeError, match="loss_fn"):
        compute_loss(torch.ones(3), None, None)


def test_run_model_call_conventions() -> None:
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, *args: object, **kwargs: object) -> int:
            seen.append((len(args), sorted(kwargs)))
            return 0

    probe = Probe()
    run_model(probe, (torch.zeros(1), torch.zeros(1)))
    run_model(probe, {"input_ids": torch.zeros(1)})
    run_model(probe, ({"input_ids": torch.zeros(1)}, torch.zeros(1)))
    run_model(probe, torch.zeros(1))
    assert seen == [(1, []), (0, ["input_ids"]), (0, ["input_ids"]), (1, [])]


def test_chunk_batch_allows_a_smaller_last_chunk() -> None:
    from hybridtrain.runtime.batch import chunk_batch

    chunks = chunk_batch((torch.arange(7), torch.arange(7)), 3)
    assert [n for _, n in chunks] == [3, 3, 1]
    assert torch.equal(chunks[2][0][0], torch.tensor([6]))
