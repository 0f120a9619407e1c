"""Starting ranks: a thin, typed front of ``torch.distributed.run`` (torchrun).

We do not bootstrap processes ourselves: torchrun's elastic agent starts the workers,
runs the c10d rendezvous (one node or many), restarts them up to ``max_restarts`` times,
and — when a worker dies — stops the others at once. What this module adds is the
argument mapping and one readable line naming the rank that failed, with the launcher's
exit code taken from it, instead of a hang or an anonymous stack trace.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchSpec:
    """Where and how many workers to start (torchrun's options, by the same names).

    Attributes:
        nproc_per_node: workers on this node (``"auto"``/``"gpu"``/``"cpu"`` or a number).
        nnodes: nodes, ``"N"`` or elastic ``"MIN:MAX"``.
        node_rank: this node's rank with a static rendezvous (``master_addr``/``master_port``).
        master_addr / master_port: address of node 0 for the static rendezvous.
        rdzv_endpoint: ``host:port`` of a c10d rendezvous (elastic, any node may start first).
        rdzv_id: job id shared by all nodes of one c10d rendezvous.
        max_restarts: times the whole worker group is restarted after a failure.
        module: run ``script`` as a module (``python -m``).
    """

    nproc_per_node: str = "1"
    nnodes: str = "1"
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "hybridtrain"
    max_restarts: int = 0
    module: bool = False

    def validate(self) -> None:
        """Raise ``ValueError`` for options that contradict each other (one line each)."""
        if self.rdzv_endpoint and (self.master_addr or self.master_port):
            raise ValueError("give either --rdzv-endpoint (c10d rendezvous) or --master-addr/--master-port "
                             "(static rendezvous), not both")
        multi_node = self.nnodes not in ("1", "1:1")
        if multi_node and not (self.rdzv_endpoint or self.master_addr):
            raise ValueError(f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT or --master-addr "
                             "(the address of node 0) so the nodes can find each other")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts {self.max_restarts} must be >= 0")


def torchrun_argv(spec: LaunchSpec, script: str, script_args: Sequence[str]) -> list[str]:
    """The ``torch.distributed.run`` command line for ``spec`` (without the program name)."""
    argv = [f"--nproc-per-node={spec.nproc_per_node}", f"--nnodes={spec.nnodes}",
            f"--max-restarts={spec.max_restarts}"]
    if spec.rdzv_endpoint:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={spec.rdzv_endpoint}", f"--rdzv-id={spec.rdzv_id}"]
    elif spec.master_addr or spec.master_port:
        argv += [f"--node-rank={spec.node_rank}", f"--master-addr={spec.master_addr or '127.0.0.1'}"]
        argv += [f"--master-port={spec.master_port}"] if spec.master_port else []
    else:
        # One node, nothing given: torchrun's standalone mode picks a free local port.
        argv.append("--standalone")
    if spec.module:
        argv.append("--module")
    return [*argv, script, *script_args]


def launch(spec: LaunchSpec, script: str, script_args: Sequence[str] = ()) -> int:
    """Run ``script`` on the workers ``spec`` describes; returns the exit code.

    Returns:
        0 when every worker succeeded; otherwise the failing worker's exit code (1 when it
        has none, e.g. killed by a signal), after printing ``error: rank R …`` to stderr.

    Raises:
        ValueError: contradictory options (see :meth:`LaunchSpec.validate`).
    """
    spec.validate()
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(torchrun_argv(spec, script, script_args)))
    except ChildFailedError as exc:
        # The ranks the agent stopped (negative code = signal) are victims; the cause is the
        # first rank that exited with an error of its own.
        rank, failure = min(exc.failures.items(),
                            key=lambda item: (item[1].exitcode <= 0, item[1].timestamp, item[0]))
        others = sorted(set(exc.failures) - {rank})
        also = f"; ranks {others} failed too" if others else ""
        print(f"error: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) exited with code "
              f"{failure.exitcode}; the launcher stopped the other ranks{also}", file=sys.stderr, flush=True)
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0
