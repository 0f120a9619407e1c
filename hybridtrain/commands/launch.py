"""``hybridtrain launch``: run a script on many processes (and nodes) through torchrun."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from hybridtrain.config.launcher_spellings import (
    add_launcher_spellings,
    apply_launcher_spellings,
    rank_entry_module,
)


def add_launch_options(parser: argparse.ArgumentParser, with_restarts: bool = True) -> None:
    """The process-placement options shared by ``launch`` and ``train``."""
    parser.add_argument("--nproc-per-node", default=None, metavar="N",
                        help="processes on this node (a number, or auto/gpu/cpu); default 1")
    parser.add_argument("--nnodes", default="1", metavar="M", help="nodes (M, or MIN:MAX for elastic); default 1")
    parser.add_argument("--node-rank", type=int, default=0, metavar="R", help="this node's rank (static rendezvous)")
    parser.add_argument("--master-addr", default=None, metavar="A", help="address of node 0 (static rendezvous)")
    parser.add_argument("--master-port", type=int, default=None, metavar="P", help="port on node 0 (static rendezvous)")
    parser.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                        help="c10d rendezvous endpoint (elastic; replaces --master-addr/--master-port)")
    parser.add_argument("--rdzv-id", default="hybridtrain", metavar="ID", help="job id shared by the nodes")
    if with_restarts:
        parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                            help="restart the worker group up to K times after a failure; default 0")


def spec_from_args(args: argparse.Namespace, module: bool = False) -> Any:
    """A :class:`~hybridtrain.parallel.launch.LaunchSpec` from parsed options."""
    from hybridtrain.parallel.launch import LaunchSpec

    return LaunchSpec(nproc_per_node=str(args.nproc_per_node or 1), nnodes=args.nnodes,
                      node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
                      rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
                      max_restarts=getattr(args, "max_restarts", 0), module=module)


def add_launch_command(sub: Any) -> None:
    """Register ``launch`` on the top-level sub-parsers."""
    parser = sub.add_parser(
        "launch", help="run a training script on many processes/nodes (torchrun)",
        description="Start SCRIPT on N processes per node with torch.distributed.run (elastic, c10d "
        "rendezvous). If a rank fails, the others are stopped and the exit code is that rank's.")
    add_launch_options(parser)
    add_launcher_spellings(parser)
    parser.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name (python -m)")
    parser.add_argument("script", metavar="SCRIPT", help="the training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments of SCRIPT")
    parser.set_defaults(func=_launch)


def _launch(args: argparse.Namespace) -> int:
    from hybridtrain.parallel.launch import launch

    try:
        os.environ.update(apply_launcher_spellings(args))
        target = ["-m", args.script] if args.module else [args.script]
        return launch(spec_from_args(args, module=True), rank_entry_module(args), [*target, *args.script_args])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
