"""The masters' shards over the ranks (:mod:`hybridtrain.deepspeed.master_shards`) and the
gradient elements a rank keeps for them (:func:`hybridtrain.deepspeed.zero_gradients.kept_range`)."""

from __future__ import annotations

import torch

from hybridtrain.deepspeed.master_shards import shard_elements, shard_rows
from hybridtrain.deepspeed.zero_gradients import kept_range


def test_rows_are_split_as_torch_chunk_splits_them() -> None:
    for rows in range(0, 9):
        for world in (1, 2, 3, 4):
            chunks = torch.arange(rows).chunk(world) if rows else ()
            expected = [(int(c[0]), int(c[-1]) + 1) for c in chunks if c.numel()]
            got = [shard_rows(rows, world, rank) for rank in range(world)]
            assert [r for r in got if r[1] > r[0]] == expected, (rows, world, got)
            assert sum(stop - start for start, stop in got) == rows


def test_a_shard_is_its_rows_of_the_flat_view() -> None:
    # Rows times the remaining dimensions.
    assert shard_elements(torch.Size([5, 3, 2]), world=2, rank=1) == (18, 30)
    assert shard_elements(torch.Size([]), world=4, rank=3) == (0, 1)  # a 0-dim master is replicated
    assert shard_elements(torch.Size([1, 8]), world=2, rank=1) == (8, 8)  # nothing on rank 1


def test_a_rank_keeps_one_range_covering_its_partition_slice_and_its_shard() -> None:
    # 16 x 8 = 128 elements over 2 ranks: shard rows 8-15 = elements 64-128 on rank 1.
    assert kept_range(torch.Size([16, 8]), (100, 28), world=2, rank=1) == (64, 128)
    assert kept_range(torch.Size([16, 8]), (0, 10), world=2, rank=1) == (0, 128)  # disjoint: the span
    assert kept_range(torch.Size([16, 8]), None, world=2, rank=0) == (0, 64)
    assert kept_range(torch.Size([1, 4]), None, world=2, rank=1) == (0, 0)  # neither: nothing kept
