"""``deepspeed.comm`` for scripts written for DeepSpeed: process-group set-up and the
rank queries scripts make, on ``torch.distributed``.

``import hybridtrain.deepspeed.comm as dist`` instead of ``import deepspeed.comm as dist``.
Collectives not defined here (``all_reduce``, ``broadcast``, …) are ``torch.distributed``'s.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as _dist

from hybridtrain.parallel.mesh import leave_process_group_at_exit

_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _backend(requested: str | None) -> str:
    """NCCL on CUDA, gloo otherwise; a requested NCCL/ccl/hccl falls back to gloo where the
    machine has no such device (DeepSpeed's CPU accelerator does the same with ccl/gloo)."""
    if requested in (None, "", "nccl") and torch.cuda.is_available():
        return "nccl"
    if requested in ("gloo", "mpi") and _dist.is_backend_available(requested):
        return requested
    return "gloo"


def launched() -> bool:
    """Whether a launcher described the process group (``RANK``, ``WORLD_SIZE``, ``MASTER_*``)."""
    return all(key in os.environ for key in _LAUNCHER_ENV)


def set_one_process_environment() -> None:
    """What DeepSpeed's launcher sets for one process on this machine (``deepspeed script.py``),
    where no launcher set anything: ``RANK``/``LOCAL_RANK`` 0, ``WORLD_SIZE`` 1, a free port."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}.items():
        os.environ.setdefault(key, value)


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True, timeout: timedelta | None = None,
                     init_method: str | None = None, dist_init_required: bool | None = None,
                     config: Any = None, rank: int = -1, world_size: int = -1) -> None:
    """Join the process group, as ``deepspeed.init_distributed`` (idempotent).

    Launched by ``hybridtrain launch`` (torchrun) or ``deepspeed``: the group the environment
    describes. Started as a plain ``python script.py`` (no ``RANK``/``WORLD_SIZE``): a
    one-process group on this machine, with ``RANK=0``, ``LOCAL_RANK=0``, ``WORLD_SIZE=1``
    set, as DeepSpeed's MPI discovery would set them, so scripts that read them run.
    """
    if dist_init_required is False or _dist.is_initialized():
        return
    if rank >= 0 and world_size > 0:
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world_size))
    if not all(key in os.environ for key in _LAUNCHER_ENV) and init_method is None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            missing = [key for key in _LAUNCHER_ENV if key not in os.environ]
            raise RuntimeError(f"init_distributed: WORLD_SIZE > 1 but {', '.join(missing)} not set; start the "
                               "script with `hybridtrain launch --num_gpus N script.py …`")
        defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
        for key, value in defaults.items():
            os.environ.setdefault(key, value)
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    backend = _backend(dist_backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    _dist.init_process_group(backend, init_method=init_method, timeout=timeout or timedelta(minutes=30))
    leave_process_group_at_exit()  # DeepSpeed scripts rarely destroy the group; gloo aborts at exit then


def is_initialized() -> bool:
    return _dist.is_available() and _dist.is_initialized()


def get_rank(group: Any = None) -> int:
    """This process's rank (0 when no process group was started)."""
    return _dist.get_rank(group) if is_initialized() else int(os.environ.get("RANK", "0"))


def get_world_size(group: Any = None) -> int:
    """Number of processes (1 when no process group was started)."""
    return _dist.get_world_size(group) if is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def get_local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK``)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def barrier(group: Any = None) -> None:
    if is_initialized():
        _dist.barrier(group)


def __getattr__(name: str) -> Any:
    # all_reduce, broadcast, ReduceOp, new_group, …: torch.distributed's own.
    try:
        return getattr(_dist, name)
    except AttributeError:
        raise AttributeError(f"module 'hybridtrain.deepspeed.comm' has no attribute {name!r}") from None
