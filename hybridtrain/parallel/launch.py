"""Starting ranks: a thin, typed front of ``torch.distributed.run`` (torchrun).

We do not bootstrap processes ourselves: torchrun's elastic agent starts the workers,
runs the c10d rendezvous (one node or many), restarts them up to ``max_restarts`` times,
and — when a worker dies — stops the others at once. What this module adds is the
argument mapping and one readable line naming the rank that failed first (not one of the
ranks that failed because it did), with the launcher's exit code taken from it, instead of
a hang or an anonymous stack trace; and one line, exit code 130, for Ctrl-C or SIGTERM.
How restarted workers avoid the dead round's rendezvous keys is in
:func:`hybridtrain.parallel.mesh.restart_store`; how a plain script's failure reaches the
launcher, in :mod:`hybridtrain.parallel.worker`.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybridtrain.parallel import exit_handshake

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure


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
        count = self.nproc_per_node
        if count not in ("auto", "gpu", "cpu", "xpu") and not (count.isdigit() and int(count) >= 1):
            raise ValueError(f"--nproc-per-node {count}: give a number of processes >= 1, or auto, gpu or cpu")


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


def local_ranks(nproc_per_node: str, cores: int) -> int:
    """How many workers torchrun starts on this node for ``--nproc-per-node``: a number,
    ``gpu`` (one per visible GPU), ``cpu`` (one per core) or ``auto`` (GPUs if any, else cores)."""
    if nproc_per_node.isdigit():
        return int(nproc_per_node)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return gpus if nproc_per_node == "gpu" or (nproc_per_node == "auto" and gpus) else cores


def threads_per_rank(cores: int, nproc_per_node: int) -> int:
    """Intra-op threads for each of ``nproc_per_node`` ranks sharing ``cores`` cores: an
    equal share, at least one, so ranks never oversubscribe the cores between them."""
    return max(1, cores // max(1, nproc_per_node))


class _QuietShutdown(logging.Filter):
    """Drops torchrun's lines about a stop the user asked for (Ctrl-C/SIGTERM), which
    :func:`launch` says in one line of its own."""

    WORDS = ("death signal", "closing signal")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(word in record.getMessage() for word in self.WORDS)


_TORCHRUN_LOGGERS = ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api")


def launch(spec: LaunchSpec, script: str, script_args: Sequence[str] = (), announce_stop: bool = True,
           rounds_keep_apart: bool = False) -> int:
    """Run ``script`` on the workers ``spec`` describes; returns the exit code.

    Returns:
        0 when every worker succeeded; otherwise the exit code of the rank that failed
        first (128 + the signal number when a signal killed it), after printing
        ``error: rank R …`` to stderr; 130 after Ctrl-C or SIGTERM, once the workers, which
        torchrun passes the signal on to, have stopped.

    Args:
        announce_stop: print the line for Ctrl-C/SIGTERM (off when the workers say it).
        rounds_keep_apart: the workers create their process group on
            :func:`~hybridtrain.parallel.mesh.restart_store` (``hybridtrain train`` does), so
            one node's restart rounds may share torchrun's store.

    Raises:
        ValueError: contradictory options (see :meth:`LaunchSpec.validate`).
    """
    spec.validate()
    for name in _TORCHRUN_LOGGERS:
        logging.getLogger(name).addFilter(_QuietShutdown())
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if spec.rdzv_endpoint or not rounds_keep_apart:
        # torchrun's c10d rendezvous shares one store across restart rounds, and a plain
        # script's init_process_group then reads the dead round's keys (mesh.restart_store
        # says how). Scripts of others cannot be changed, and several nodes' agents count
        # restarts separately (a node that joins later starts at 0, so the per-restart
        # prefix is not common to all): then every round's rank 0 serves a fresh store.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # torchrun sets OMP_NUM_THREADS=1 for every rank when there are several per node, which
    # leaves the host optimizer step (memory-bound, needs every core's load units) on one
    # core per rank. Give each rank its share of the cores this process may use instead;
    # a value the user set wins.
    cores = len(os.sched_getaffinity(0))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(cores, local_ranks(spec.nproc_per_node, cores))))
    from hybridtrain.parallel.worker import FINISHED_DIR_ENV

    # Where the ranks say that their script ended (see finished_ranks); passed on by torchrun.
    finished_dir = tempfile.mkdtemp(prefix="hybridtrain-finished-")
    os.environ[FINISHED_DIR_ENV] = finished_dir
    nodes = exit_handshake.static_nodes(spec.nnodes, spec.master_addr, spec.rdzv_endpoint)
    addr, port = spec.master_addr or "127.0.0.1", spec.master_port or exit_handshake.TORCHRUN_PORT
    store = exit_handshake.host_store(addr, port) if nodes and spec.node_rank == 0 else None
    try:
        run(parse_args(torchrun_argv(spec, script, script_args)))
        if store is not None:
            exit_handshake.wait_for_nodes(store, nodes)
        elif nodes:
            exit_handshake.say_done(addr, port)
    except ChildFailedError as exc:
        done = finished_ranks(exc.failures)
        failures = {r: f for r, f in exc.failures.items() if r not in done}
        if not failures:  # every rank's script ended; one died in the interpreter's teardown after it
            print(f"warning: {_finished_line(exc.failures)}; the run finished", file=sys.stderr, flush=True)
            return 0
        rank = first_failure(failures)
        failure = failures[rank]
        others = sorted(set(failures) - {rank})
        also = f"; ranks {others} failed too" if others else ""
        print(f"error: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {_describe_exit(failure)}; "
              f"the launcher stopped the other ranks{also}", file=sys.stderr, flush=True)
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    except SignalException as exc:
        if announce_stop:
            print(f"interrupted by {exc.sigval.name}: every rank was told to stop and has exited",
                  file=sys.stderr, flush=True)
        return 130
    finally:
        del os.environ[FINISHED_DIR_ENV]
        shutil.rmtree(finished_dir, ignore_errors=True)
    return 0


_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
"""What torchrun's agent sends the ranks it stops (its death signal, or the one it got)."""


def first_failure(failures: Mapping[int, ProcessFailure]) -> int:
    """The rank whose failure caused the others'.

    When a rank dies, its peers fail too: their collectives lose the connection (an error
    of their own, with an error file saying so) or the agent stops them (SIGTERM).
    Exit codes and timestamps (whole seconds, mostly the moment the agent looked) do not
    tell them apart, so ranks are ordered by what happened to them: killed by a signal
    nobody in the job sent (``kill -9``, a segfault, the OOM killer), then an error of
    their own, then a lost peer, then stopped by the agent; ties by time, then rank.
    """
    def order(item: tuple[int, ProcessFailure]) -> tuple[int, int, int]:
        rank, failure = item
        if failure.exitcode < 0:
            kind = 3 if -failure.exitcode in _STOP_SIGNALS else 0
        else:
            kind = 2 if _lost_peer(failure) else 1
        return kind, failure.timestamp, rank

    return min(failures.items(), key=order)[0]


def finished_ranks(failures: Mapping[int, ProcessFailure]) -> set[int]:
    """The ranks among ``failures`` that were killed by a signal after their script had ended
    normally: the worker (:mod:`hybridtrain.parallel.worker`) left its marker once the script
    and its atexit handlers returned."""
    from hybridtrain.parallel.worker import finished_marker

    return {rank for rank, failure in failures.items()
            if failure.exitcode < 0 and os.path.exists(finished_marker(rank) or "")}


def _finished_line(failures: Mapping[int, ProcessFailure]) -> str:
    kills = ", ".join(f"rank {rank} by {failure.signal_name()}" for rank, failure in sorted(failures.items()))
    return f"every rank finished its script; killed afterwards, while the interpreter shut down: {kills}"


def _lost_peer(failure: ProcessFailure) -> bool:
    # hybridtrain's workers record a dead peer as PeerFailure("lost contact with another
    # rank …"); other scripts' error files (torchrun's @record) carry gloo's own words.
    recorded = _recorded_error(failure)
    return any(words in recorded for words in ("lost contact with another rank", "Connection reset by peer",
                                           "Connection closed by peer"))


def _describe_exit(failure: ProcessFailure) -> str:
    if failure.exitcode < 0:
        return f"was killed by {failure.signal_name()}"
    recorded = _recorded_error(failure)
    return f"exited with code {failure.exitcode}" + (f" ({recorded})" if recorded else "")


def _recorded_error(failure: ProcessFailure) -> str:
    """The exception a worker recorded in its error file (``TORCHELASTIC_ERROR_FILE``), one line."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    if not isinstance(message, str) or message.startswith("To enable traceback"):
        return ""
    text = " ".join(message.split())
    return text if len(text) <= 300 else text[:297] + "..."
