"""ZeRO-1/2's flat layout (:mod:`hybridtrain.deepspeed.checkpoint.flat`) against the numbers
DeepSpeed's optimizer gives for the same groups."""

from __future__ import annotations

import pytest
import torch

from hybridtrain.deepspeed.checkpoint import flat


@pytest.mark.parametrize(("total", "dp", "size", "paddings"), [
    (66, 1, 66, [0]),        # one rank: a multiple of 2
    (66, 2, 34, [0, 2]),     # 68 = 17 × 4; the last rank carries the 2 padding elements
    (5, 4, 2, [0, 0, 1, 2]),  # 8 = 1 × 8: a rank past the group's end is all padding
])
def test_partition_sizes_and_end_paddings_are_deepspeeds(total: int, dp: int, size: int, paddings: list[int]) -> None:
    assert flat.partition_size(total, dp) == size
    assert flat.paddings(total, dp) == paddings


def test_rank_slices_put_together_give_the_group_back_and_split_cuts_it_by_shape() -> None:
    tensors = [torch.arange(6.0).reshape(2, 3), torch.tensor([7.0, 8.0, 9.0])]
    whole = flat.flatten(tensors)
    slices = [flat.rank_slice(whole, 2, r, padded=False) for r in range(2)]
    padded = [flat.rank_slice(whole, 2, r, padded=True) for r in range(2)]
    assert [s.numel() for s in slices] == [6, 3] and [p.numel() for p in padded] == [6, 6]
    assert torch.equal(padded[1][3:], torch.zeros(3))
    parts = flat.split(torch.cat(slices), [torch.Size([2, 3]), torch.Size([3])])
    assert all(torch.equal(a, b) for a, b in zip(parts, tensors, strict=True))


def test_split_skips_parameter_alignment_gaps_and_refuses_too_few_elements() -> None:
    data = torch.tensor([1.0, 2.0, 0.0, 0.0, 3.0])
    first, second = flat.split(data, [torch.Size([2]), torch.Size([1])], gaps=[2, 0])
    assert first.tolist() == [1.0, 2.0] and second.tolist() == [3.0]
    with pytest.raises(ValueError, match="holds 2 elements, its parameters need 3"):
        flat.split(torch.zeros(2), [torch.Size([3])])
