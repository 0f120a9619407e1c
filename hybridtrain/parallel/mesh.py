"""The process topology: ``dp × tp × pp`` ranks on one ``DeviceMesh``.

Rank layout (``pp`` outermost, ``tp`` innermost, so tensor-parallel peers — the chattiest
group — are neighbours, i.e. on one node when a node holds ``tp`` ranks)::

    rank = pp_rank · (dp · tp) + dp_rank · tp + tp_rank

    8 ranks, dp=2 tp=2 pp=2:   stage 0: replica 0 = [0 1]   replica 1 = [2 3]
                               stage 1: replica 0 = [4 5]   replica 1 = [6 7]

Sizes are checked by :func:`resolve_sizes` with no process group needed, so bad sizes fail
on every rank before any collective starts.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hybridtrain.runtime.batch import Batch, batch_size, split_batch

MESH_DIMS = ("pp", "dp", "tp")
_log = logging.getLogger(__name__)


def env_world_size() -> int:
    """The world size ``torchrun`` announced (1 when not launched by it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


SIZE_KEYS = ("data_parallel.size", "tensor_model_parallel_size", "pipeline_model_parallel_size")


def resolve_sizes(world_size: int, dp: int, tp: int, pp: int,
                  names: tuple[str, str, str] = SIZE_KEYS) -> tuple[int, int, int]:
    """Fill in a ``-1`` size as "the rest" and check that ``dp × tp × pp == world_size``.

    Args:
        world_size: number of processes.
        dp / tp / pp: data-, tensor- and pipeline-parallel sizes; at most one may be -1.
        names: the config keys the three sizes came from (named in errors).

    Returns:
        ``(dp, tp, pp)``, all positive.

    Raises:
        ValueError: more than one -1, a size below -1 or 0, or sizes that do not multiply
            to the world size (the message names all four numbers and the fix).
    """
    sizes = dict(zip(names, (dp, tp, pp), strict=True))
    bad = [f"{k}={v}" for k, v in sizes.items() if v == 0 or v < -1]
    if bad:
        raise ValueError(f"{', '.join(bad)} is not allowed; sizes are positive or -1 (= the rest)")
    rest = [k for k, v in sizes.items() if v == -1]
    if len(rest) > 1:
        raise ValueError(f"{' and '.join(rest)} are both -1; at most one size can be 'the rest'")
    known = 1
    for value in sizes.values():
        known *= value if value > 0 else 1
    shown = ", ".join(f"{k}={v}" for k, v in sizes.items())
    if world_size % known:
        raise ValueError(f"{shown} do not divide the world size {world_size}; launch a multiple "
                         f"of {known} processes (hybridtrain launch --nproc-per-node {known} …)")
    if rest:
        sizes[rest[0]] = world_size // known
    elif known != world_size:
        raise ValueError(f"{shown} multiply to {known}, but the world size is {world_size}; set one "
                         "of them to -1 (= the rest) or launch that many processes")
    return sizes[names[0]], sizes[names[1]], sizes[names[2]]


def backend_for(device: torch.device, host_collectives: bool = False) -> str:
    """The collective backend for a device: NCCL on CUDA, gloo on CPU.

    ``host_collectives``: CUDA ranks also reduce host tensors (ZeRO with CPU offload: FSDP2's
    ``CPUOffloadPolicy`` keeps the shards and gradients in host memory, so gradient-norm
    clipping and ``full_tensor()`` run collectives on CPU tensors, which NCCL refuses with
    "No backend type associated with device type cpu"); then each device type gets its
    backend, as torchtitan does."""
    if device.type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if host_collectives else "nccl"


def init_process_group(device: torch.device, timeout_s: float = 600.0, host_collectives: bool = False) -> None:
    """Join the process group ``torchrun`` described in the environment (idempotent).

    A finite timeout turns a peer that died mid-collective into an error instead of a hang.
    After a restart the group is built on :func:`restart_store`, so that it does not meet
    the keys of the round that died.
    """
    leave_process_group_at_exit()  # also for a group the program made itself
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    store = restart_store(timeout)
    if store is None:
        dist.init_process_group(backend_for(device, host_collectives), timeout=timeout)
    else:
        dist.init_process_group(backend_for(device, host_collectives), timeout=timeout, store=store,
                                rank=int(os.environ["RANK"]), world_size=env_world_size())


_LEAVING_AT_EXIT: list[bool] = []


def leave_process_group_at_exit() -> None:
    """Make the interpreter leave the process group at exit if the program does not
    (registered once per process; a no-op at exit when there is no group).

    Why: a process that exits with its gloo group alive tears the group down during
    interpreter finalization, where gloo's worker threads still hold work objects with
    Python references; freeing them then needs the GIL of an interpreter that is going
    away, and a rank that trained to the end dies of SIGABRT ("terminate called without an
    active exception"), a failed run for the launcher. An atexit handler runs while the
    interpreter is whole, and after the handlers the program registered itself (atexit is
    last-in, first-out), which may still use the group."""
    if not _LEAVING_AT_EXIT:
        _LEAVING_AT_EXIT.append(True)
        atexit.register(leave_process_group)


def leave_process_group() -> None:
    """Destroy every process group of this process, without a barrier (a peer may be gone,
    and every collective of a finished program has returned); a no-op without one."""
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def end_process_group() -> None:
    """Leave the process group at the end of a run every rank finished (no-op without one).

    Without it gloo's worker threads outlive the interpreter's teardown, and a rank that
    trained to the end can still die of SIGABRT at exit ("terminate called without an active
    exception"), which torchrun counts as a failure. Only for a run that ended on every rank:
    with a peer gone, the barrier would wait for it (torchtitan calls it only on success too).
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def restart_count() -> int:
    """How many times torchrun has restarted this worker group (0 in the first round)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def restart_store(timeout: timedelta) -> dist.Store | None:
    """This restart round's own view of the key-value store torchrun's agent serves, or
    None where the usual ``env://`` rendezvous is safe.

    Why: since torch 2.4 torchrun's c10d rendezvous lets the workers share the agent's
    TCPStore (``TORCHELASTIC_USE_AGENT_STORE=True``; ``DynamicRendezvousHandler`` creates
    that server once, ``_shared_tcp_store_server``, and hands the same port to every
    round), and ``init_process_group`` puts its keys under a fixed ``default_pg`` prefix.
    After a restart the keys of the dead round are still there: gloo's full-mesh connect
    reads a peer's *old* address before the peer has written its new one and fails with
    ``Connection refused`` (or hangs connecting to a reused port). Every round's keys go
    under ``hybridtrain/restart-<TORCHELASTIC_RESTART_COUNT>/`` here, so a round only ever
    reads what its own ranks wrote.

    The restart count is one agent's: with several nodes the agents count separately (a
    node whose agent was replaced starts again at 0), so there the usual rendezvous is kept;
    ``hybridtrain launch`` and the deploy manifests set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
    so that every round gets a fresh store instead.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        _log.info("several nodes share torchrun's store across restart rounds; set "
                  "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (hybridtrain launch does) so that restarts "
                  "do not meet the dead round's rendezvous keys")
        return None
    return _round_store("", timeout)


def _round_store(name: str, timeout: timedelta) -> dist.Store:
    # A client of the store torchrun's workers share (the agent's, or the one rank 0
    # serves for env://), seeing only this restart round's keys.
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env_world_size(),
                           is_master=False, timeout=timeout)
    return dist.PrefixStore(f"hybridtrain/restart-{restart_count()}{name}", client)


def stalled_ranks(grace_s: float = 3.0) -> list[int]:
    """After a collective timed out here: the ranks that did not time out too, i.e. the ones
    that never reached the collective (stuck or dead). Every rank that times out says so in
    the store and waits ``grace_s`` for the others to say the same.

    Returns:
        The stalled ranks; empty when every rank timed out (collectives called in a
        different order) or the store cannot be reached.
    """
    world, rank = env_world_size(), int(os.environ.get("RANK", "0"))
    try:
        store = _round_store("/timed-out", timedelta(seconds=grace_s + 10))
        store.set(str(rank), "1")
        time.sleep(grace_s)
        return [r for r in range(world) if not store.check([str(r)])]
    except (RuntimeError, KeyError, ValueError):  # no store any more: say nothing rather than guess
        return []


@dataclass(frozen=True)
class Topology:
    """Where this process sits in ``dp × tp × pp``.

    Attributes:
        world_size / rank: global numbers.
        dp / tp / pp: the three sizes (product = world size).
        dp_rank / tp_rank / pp_rank: this process's coordinate along each.
        mesh: the ``DeviceMesh`` with dims ``("pp", "dp", "tp")`` (None in one process).
    """

    world_size: int = 1
    rank: int = 0
    dp: int = 1
    tp: int = 1
    pp: int = 1
    dp_rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    mesh: DeviceMesh | None = None

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank runs the first pipeline stage."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank runs the last pipeline stage."""
        return self.pp_rank == self.pp - 1

    def group(self, dim: str) -> dist.ProcessGroup | None:
        """The process group of this rank's peers along ``dim`` (``pp``/``dp``/``tp``)."""
        return self.mesh.get_group(dim) if self.mesh is not None else None

    def submesh(self, dim: str) -> DeviceMesh | None:
        """The one-dimensional mesh along ``dim`` (None in one process)."""
        return self.mesh[dim] if self.mesh is not None else None

    def local_batch(self, global_batch: Batch) -> Batch:
        """This rank's data-parallel shard of ``global_batch`` (the replica's share).

        Ranks of one replica (its pipeline stages and tensor-parallel peers) get the same
        shard; replica ``i`` gets the ``i``-th of ``dp`` equal slices.

        Raises:
            ValueError: the batch size is not divisible by the data-parallel size.
        """
        if self.dp == 1:
            return global_batch
        size = batch_size(global_batch)
        if size % self.dp:
            raise ValueError(f"global batch of {size} samples does not split over data_parallel.size="
                             f"{self.dp} replicas; use a multiple of {self.dp}")
        return split_batch(global_batch, self.dp)[self.dp_rank]

    def describe(self) -> dict[str, Any]:
        """Sizes and coordinates as a plain dict (for logs and checkpoints)."""
        return {"world_size": self.world_size, "rank": self.rank, "dp": self.dp, "tp": self.tp,
                "pp": self.pp, "dp_rank": self.dp_rank, "tp_rank": self.tp_rank, "pp_rank": self.pp_rank}


def build_topology(device: torch.device, dp: int, tp: int, pp: int) -> Topology:
    """Create the ``DeviceMesh`` for already-resolved sizes (a collective on every rank).

    Args:
        device: this rank's device (picks the mesh's device type).
        dp / tp / pp: sizes from :func:`resolve_sizes`.
    """
    world = dp * tp * pp
    if world == 1:
        return Topology()
    mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=MESH_DIMS)
    rank = dist.get_rank()
    pp_rank, rest = divmod(rank, dp * tp)
    dp_rank, tp_rank = divmod(rest, tp)
    return Topology(world, rank, dp, tp, pp, dp_rank, tp_rank, pp_rank, mesh)
