"""The entrypoint of a job on Ray: one ``hybridtrain launch`` rank group per node.

    python -m hybridtrain.service.ray_driver --nodes M --devices N -- ARGV...

Run by Ray Jobs on the cluster. It reserves M bundles of N devices (a placement group,
spread over the nodes), learns the address of the first bundle's node, and runs ARGV on
each bundle as one node of a static rendezvous (``--nnodes M --node-rank R --master-addr
A --master-port P`` for ``hybridtrain train``/``launch``; the same values as ``NNODES``,
``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` for any other program). Its exit code is
the first failing node's. SIGTERM (``ray job stop``, a cancel) is passed to every node's
processes, so a trainer saves its checkpoint and exits 130 as it does locally.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

#: Programs that take the rendezvous as options rather than only as variables.
_LAUNCHERS = ("hybridtrain.parallel.launch_cli", "hybridtrain.cli")


def node_argv(argv: Sequence[str], nodes: int, rank: int, addr: str, port: int,
              devices: int) -> list[str]:
    """``argv`` for node ``rank``: rendezvous options added to hybridtrain's launchers."""
    out = list(argv)
    launcher = next((name for name in _LAUNCHERS if name in out), None)
    if nodes == 1 or launcher is None:
        return out
    options = ["--nnodes", str(nodes), "--node-rank", str(rank), "--master-addr", addr,
               "--master-port", str(port)]
    if "--nproc-per-node" not in out:
        options += ["--nproc-per-node", str(max(devices, 1))]
    # launch takes its options before the script (whose own arguments follow it); train
    # takes them anywhere.
    at = out.index(launcher) + 1 if launcher == _LAUNCHERS[0] else len(out)
    return out[:at] + options + out[at:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _run_node(argv: list[str], env: dict[str, str]) -> int:
    """Run one node's program; on cancel (KeyboardInterrupt from ``ray.cancel``) SIGTERM
    its process group and wait for it, so it can save a checkpoint."""
    proc = subprocess.Popen(argv, env=os.environ | env, start_new_session=True)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        return proc.wait()


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
    run = ray.remote(_run_node)
    refs = []
    for rank in range(opts.nodes):
        env = {"NNODES": str(opts.nodes), "NODE_RANK": str(rank), "MASTER_ADDR": str(addr),
               "MASTER_PORT": str(port)}
        resources = {"num_gpus": opts.devices} if gpu else {
            "num_cpus": max(opts.devices, 1)}
        refs.append(run.options(scheduling_strategy=on(rank), **resources).remote(
            node_argv(argv, opts.nodes, rank, addr, port, opts.devices), env))

    def stop(_signum: int, _frame: Any) -> None:
        for ref in refs:
            ray.cancel(ref, force=False)

    signal.signal(signal.SIGTERM, stop)
    codes = []
    for ref in refs:
        try:
            codes.append(int(ray.get(ref)))
        except (ray.exceptions.TaskCancelledError, ray.exceptions.RayTaskError):
            codes.append(130)
    failed = [c for c in codes if c != 0]
    return failed[0] if failed else 0


if __name__ == "__main__":
    sys.exit(main())
