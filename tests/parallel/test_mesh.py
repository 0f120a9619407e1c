"""Topology: sizes (-1 = the rest), rank coordinates on the DeviceMesh, local batches."""

from __future__ import annotations

import pytest
import torch

import hybridtrain as ht
from hybridtrain.config import ConfigError
from hybridtrain.parallel import mesh
from tests.parallel.spawn import run_ranks


@pytest.mark.parametrize(("world", "sizes", "expected"), [
    (8, (-1, 2, 2), (2, 2, 2)),
    (8, (2, -1, 2), (2, 2, 2)),
    (4, (-1, 1, 1), (4, 1, 1)),
    (6, (3, 2, 1), (3, 2, 1)),
    (1, (-1, 1, 1), (1, 1, 1)),
])
def test_sizes_resolve(world: int, sizes: tuple[int, int, int], expected: tuple[int, int, int]) -> None:
    assert mesh.resolve_sizes(world, *sizes) == expected


@pytest.mark.parametrize(("world", "sizes", "needle"), [
    (6, (-1, 4, 1), "do not divide the world size 6"),
    (8, (2, 2, 1), "multiply to 4, but the world size is 8"),
    (8, (-1, -1, 2), "are both -1"),
    (8, (0, 2, 2), "data_parallel.size=0 is not allowed"),
])
def test_bad_sizes_are_one_line_errors(world: int, sizes: tuple[int, int, int], needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as err:
        mesh.resolve_sizes(world, *sizes)
    assert "\n" not in str(err.value)


def test_local_batch_is_the_replica_shard() -> None:
    batch = (torch.arange(8)[:, None], torch.arange(8)[:, None] * 10)
    topo = mesh.Topology(world_size=4, rank=3, dp=2, tp=2, dp_rank=1, tp_rank=1)
    inputs, targets = topo.local_batch(batch)
    assert inputs.flatten().tolist() == [4, 5, 6, 7] and targets.flatten().tolist() == [40, 50, 60, 70]
    with pytest.raises(ValueError, match="multiple of 2"):
        topo.local_batch(torch.zeros(3, 1))
    assert mesh.Topology().local_batch(batch) is batch


def _topologies(sizes: tuple[int, int, int]) -> dict[str, int]:
    mesh.init_process_group(torch.device("cpu"))
    topo = mesh.build_topology(torch.device("cpu"), *sizes)
    groups = {dim: torch.distributed.get_process_group_ranks(topo.group(dim)) for dim in mesh.MESH_DIMS}
    return {**topo.describe(), **{f"{d}_group": g for d, g in groups.items()}}


def test_mesh_coordinates_on_four_ranks() -> None:
    ranks = run_ranks(_topologies, 4, (2, 1, 2), timeout=90)  # dp=2, tp=1, pp=2
    for rank, info in enumerate(ranks):
        pp_rank, dp_rank = divmod(rank, 2)
        assert (info["rank"], info["pp_rank"], info["dp_rank"], info["tp_rank"]) == (rank, pp_rank, dp_rank, 0)
    assert ranks[3]["dp_group"] == [2, 3] and ranks[3]["pp_group"] == [1, 3] and ranks[3]["tp_group"] == [3]


def test_world_size_that_does_not_fit_fails_before_any_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    # WORLD_SIZE says 3 but no process group exists: an error (not a hang) proves the check
    # runs before init_process_group.
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="data_parallel.size=2"):
        ht.initialize(torch.nn.Linear(2, 2), {"device": "cpu", "data_parallel": {"size": 2}})


def test_batch_that_does_not_split_over_replicas_fails_before_any_collective(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="data-parallel size=2"):
        ht.initialize(torch.nn.Linear(2, 2), {"device": "cpu", "train_batch_size": 3})


def test_zero_with_cpu_offload_on_cuda_gets_a_host_backend_beside_nccl() -> None:
    """FSDP2's CPU offload reduces host tensors (clipping, full_tensor): NCCL alone refuses them."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert mesh.backend_for(cuda) == "nccl"
    assert mesh.backend_for(cuda, host_collectives=True) == "cuda:nccl,cpu:gloo"
    assert mesh.backend_for(cpu, host_collectives=True) == "gloo"
