"""The ``deepspeed`` launcher's spellings for ``hybridtrain launch``, beside the DeepSpeed key
table (:mod:`hybridtrain.config.deepspeed_keys`): its flags (``--num_gpus``, ``--hostfile``,
``--include`` …) folded into the torchrun options, and the module each rank starts in (the
DeepSpeed drop-in's entry unless ``--no-dropin``)."""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
from typing import Any


def rank_entry_module(args: argparse.Namespace) -> str:
    """The module each launched rank runs the script through.

    Both record an uncaught exception where the launcher reads which rank failed first
    (:mod:`hybridtrain.parallel.worker`); by default the DeepSpeed drop-in's entry runs
    first, so that in the ranks (and only there) ``import deepspeed`` is hybridtrain's
    drop-in, as under ``python -m hybridtrain.deepspeed``."""
    return "hybridtrain.parallel.worker" if args.no_dropin else "hybridtrain.deepspeed"


def add_launcher_spellings(parser: argparse.ArgumentParser) -> None:
    """The ``deepspeed`` launcher's common flags, so its command lines work unchanged, and
    ``--no-dropin`` (see :func:`rank_entry_module`)."""
    parser.add_argument("--no-dropin", action="store_true",
                        help="let `import deepspeed` in SCRIPT load the installed package instead of "
                        "hybridtrain's drop-in (hybridtrain.deepspeed)")
    group = parser.add_argument_group("deepspeed launcher flags", "the `deepspeed` command's spellings")
    group.add_argument("--num_gpus", "--num_accelerators", type=int, default=None, metavar="N",
                       help="processes on this node (= --nproc-per-node)")
    group.add_argument("--num_nodes", type=int, default=None, metavar="M", help="nodes (= --nnodes)")
    group.add_argument("--master_addr", dest="ds_master_addr", default=None, metavar="A", help="= --master-addr")
    group.add_argument("--master_port", dest="ds_master_port", type=int, default=None, metavar="P",
                       help="= --master-port")
    group.add_argument("--node_rank", dest="ds_node_rank", type=int, default=None, metavar="R", help="= --node-rank")
    group.add_argument("-H", "--hostfile", default=None, metavar="FILE",
                       help="MPI-style hostfile; only one host (this one) is supported: its slots are the processes")
    group.add_argument("-i", "--include", default="", metavar="SPEC",
                       help="devices of this host to use, e.g. localhost:0,2 (sets CUDA_VISIBLE_DEVICES)")
    group.add_argument("-e", "--exclude", default="", metavar="SPEC", help="devices of this host not to use")
    group.add_argument("--no_local_rank", action="store_true",
                       help="accepted; scripts get LOCAL_RANK in the environment, never --local_rank")
    group.add_argument("--bind_cores_to_rank", action="store_true", help="accepted and ignored")


def apply_launcher_spellings(args: argparse.Namespace) -> dict[str, str]:
    """Fold the ``deepspeed`` spellings into the torchrun options (in ``args``).

    Returns:
        Environment variables the workers need (``CUDA_VISIBLE_DEVICES`` for
        ``--include``/``--exclude``).

    Raises:
        ValueError: a flag that cannot work here (several hosts, contradicting values).
    """
    def same(name: str, ours: Any, theirs: Any, default: Any = None) -> Any:
        if theirs is None:
            return ours
        if ours not in (default, theirs):
            raise ValueError(f"{name} {ours} contradicts the deepspeed spelling's value {theirs}; give one")
        return theirs

    env: dict[str, str] = {}
    slots = _hostfile_slots(args.hostfile) if args.hostfile else None
    if args.include and args.exclude:
        raise ValueError("--include and --exclude are mutually exclusive (as in deepspeed)")
    devices = _select_devices(args.include, args.exclude) if args.include or args.exclude else None
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
        args.num_gpus = same("--num_gpus", len(devices), args.num_gpus)
    if slots is not None and args.num_gpus is None and args.nproc_per_node is None:
        args.num_gpus = slots
    args.nproc_per_node = same("--nproc-per-node", args.nproc_per_node, None if args.num_gpus is None
                               else str(args.num_gpus))
    args.nnodes = same("--nnodes", args.nnodes, None if args.num_nodes is None else str(args.num_nodes), "1")
    args.master_addr = same("--master-addr", args.master_addr, args.ds_master_addr)
    args.master_port = same("--master-port", args.master_port, args.ds_master_port)
    args.node_rank = same("--node-rank", args.node_rank, args.ds_node_rank, 0)
    if args.bind_cores_to_rank:
        print("note: --bind_cores_to_rank is ignored by hybridtrain launch", file=sys.stderr)
    return env


_LOCAL_HOSTS = {"localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn()}


def _hostfile_slots(path: str) -> int | None:
    """Slots of the one (local) host in an MPI-style hostfile; None when the file does not
    exist (deepspeed then runs on local resources)."""
    if not os.path.isfile(path):
        print(f"note: hostfile {path} not found; running on this machine only", file=sys.stderr)
        return None
    hosts: dict[str, int] = {}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            match = re.match(r"^(\S+)\s+slots=(\d+)", line)
            if not match:
                raise ValueError(f"hostfile {path}: bad entry {line!r} (want 'HOST slots=N')")
            hosts[match.group(1)] = int(match.group(2))
    if len(hosts) != 1 or next(iter(hosts)) not in _LOCAL_HOSTS:
        raise ValueError(f"hostfile {path} lists {', '.join(hosts) or 'no hosts'}: hybridtrain launch does not ssh "
                         "into other hosts; run `hybridtrain launch --nnodes N --node-rank R --master-addr HOST0 "
                         "SCRIPT` on each node instead")
    return next(iter(hosts.values()))


def _select_devices(include: str, exclude: str) -> list[int]:
    """Device ids of this host chosen by deepspeed's ``NAME[:SLOT,…][@…]`` syntax."""
    spec = include or exclude
    nodes = [part for part in spec.split("@") if part]
    names = {node.split(":")[0] for node in nodes}
    if len(nodes) != 1 or not names <= _LOCAL_HOSTS:
        raise ValueError(f"--{'include' if include else 'exclude'} {spec!r} names other hosts: hybridtrain launch "
                         "runs on this host only (use localhost:SLOTS), one launch per node")
    name, _, slot_text = nodes[0].partition(":")
    slots = [int(s) for s in slot_text.split(",") if s.strip()] if slot_text else []
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError(f"--{'include' if include else 'exclude'} selects GPUs, but this machine has none; "
                         "use --num_gpus N for N CPU processes")
    if any(s < 0 or s >= count for s in slots):
        raise ValueError(f"device ids {slots} out of range: this host has {count} GPUs")
    if include:
        return slots or list(range(count))
    return [d for d in range(count) if d not in slots] if slots else []
