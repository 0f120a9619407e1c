"""The entrypoint of a job on Ray: one ``hybridtrain launch`` rank group per node.

    python -m hybridtrain.service.ray_driver --nodes M --devices N -- ARGV...

Run by Ray Jobs on the cluster. It reserves M bundles of N devices (a placement group,
spread over the nodes), learns the address of the first bundle's node, and runs ARGV on
each bundle as one node of a static rendezvous (``--nnodes M --node-rank R --master-addr
A --master-port P`` for ``hybridtrain train``/``launch``; the same values as ``NNODES``,
``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` for any other program). Its exit code is
the first failing node's. SIGTERM (``ray job stop``, a cancel) is passed to every node's
processes (each node runs in an actor that can be told to stop while it waits), so a trainer
saves its checkpoint and exits 130 as it does locally, and that code is what the job reports.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

#: hybridtrain's commands that take the rendezvous as options rather than only as variables.
_LAUNCHERS = ("launch", "train")


def _launcher(argv: Sequence[str]) -> tuple[str, int] | None:
    """``(command, index after it)`` of ``python -m hybridtrain launch|train`` in ``argv``."""
    for at in range(len(argv) - 2):
        if argv[at:at + 2] == ["-m", "hybridtrain"] and argv[at + 2] in _LAUNCHERS:
            return argv[at + 2], at + 3
    return None


def node_argv(argv: Sequence[str], nodes: int, rank: int, addr: str, port: int,
              devices: int) -> list[str]:
    """``argv`` for node ``rank``: rendezvous options added to hybridtrain's launchers."""
    out = list(argv)
    found = _launcher(out)
    if nodes == 1 or found is None:
        return out
    launcher, after = found
    options = ["--nnodes", str(nodes), "--node-rank", str(rank), "--master-addr", addr,
               "--master-port", str(port)]
    if "--nproc-per-node" not in out:
        options += ["--nproc-per-node", str(max(devices, 1))]
    # launch takes its options before the script (whose own arguments follow it); train
    # takes them anywhere.
    at = after if launcher == "launch" else len(out)
    return out[:at] + options + out[at:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class _Node:
    """One node's program, as a Ray actor: ``run`` starts and waits for it, ``stop``
    (called concurrently) SIGTERMs its process group, so ``run`` returns its real exit code
    (130 for a trainer that saved a checkpoint), not a cancellation."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopped = False

    def run(self, argv: list[str], env: dict[str, str]) -> int:
        if self.stopped:
            return 128 + signal.SIGTERM  # stopped before it started
        print(f"node {env['NODE_RANK']} of {env['NNODES']} on {socket.gethostname()}: {_devices()}", flush=True)
        self.proc = subprocess.Popen(argv, env=os.environ | env, start_new_session=True)
        return self.proc.wait()

    def stop(self) -> None:
        self.stopped = True
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)


def _devices() -> str:
    """What Ray gave this node's program: its GPU ids, else its CPU cores."""
    import ray

    gpus = ray.get_gpu_ids()
    if gpus:
        return "GPUs " + ",".join(str(g) for g in gpus)
    cores = ray.get_runtime_context().get_assigned_resources().get("CPU", 0)
    return f"{cores:g} CPU cores"


def main(args: Sequence[str] | None = None) -> int:
    """Run the job (module docstring); returns its exit code."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    parser = argparse.ArgumentParser(prog="python -m hybridtrain.service.ray_driver")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    opts = parser.parse_args(args)
    argv = opts.argv[1:] if opts.argv[:1] == ["--"] else opts.argv
    ray.init()
    # Devices are GPUs on a cluster that has them, CPU cores on one that has none.
    gpu = opts.devices > 0 and ray.cluster_resources().get("GPU", 0) > 0
    bundle = {"GPU": float(opts.devices), "CPU": 1.0} if gpu else {
        "CPU": float(max(opts.devices, 1))}
    group = placement_group([bundle] * opts.nodes, strategy="SPREAD")
    ray.get(group.ready())

    def on(rank: int) -> Any:
        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)

    where = ray.remote(num_cpus=0)(lambda: (ray.util.get_node_ip_address(), _free_port()))
    addr, port = ray.get(where.options(scheduling_strategy=on(0)).remote())
    node = ray.remote(_Node)
    actors: list[Any] = []  # Ray's actor handles (untyped)
    refs: list[Any] = []
    for rank in range(opts.nodes):
        env = {"NNODES": str(opts.nodes), "NODE_RANK": str(rank), "MASTER_ADDR": str(addr),
               "MASTER_PORT": str(port)}
        resources = {"num_gpus": opts.devices} if gpu else {
            "num_cpus": max(opts.devices, 1)}
        # Two calls at once: stop() while run() waits.
        actor: Any = node.options(max_concurrency=2, scheduling_strategy=on(rank),
                             **resources).remote()
        actors.append(actor)
        refs.append(actor.run.remote(node_argv(argv, opts.nodes, rank, addr, port,
                                               opts.devices), env))

    # SIGTERM only sets a flag: the loop below, not the handler, talks to Ray.
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda _signum, _frame: stopping.set())
    pending, stopped = list(refs), False
    while pending:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
        if stopping.is_set() and not stopped:
            stopped = True
            ray.get([actor.stop.remote() for actor in actors])
    codes = [int(code) for code in ray.get(refs)]
    failed = [c for c in codes if c != 0]
    return failed[0] if failed else 0


if __name__ == "__main__":
    sys.exit(main())
