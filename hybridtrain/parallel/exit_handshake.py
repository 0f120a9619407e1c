"""Node 0 keeps the rendezvous store up until every node's launcher has left torchrun.

With a static rendezvous (``--nnodes M --node-rank R --master-addr A --master-port P``)
torchrun's agent on node 0 hosts the TCP store that all agents share, and at the end of a
successful run every agent meets the others at the store's exit barrier. When the last node
to arrive is not node 0, it writes the barrier's key and then asks the store for it; node 0,
woken by the key, can leave torchrun and close the store before that last request is
answered. The run has succeeded, yet that node's log then holds torch's "Error waiting on
exit barrier" and a C++ stack trace (seen under load, on Ray jobs of two nodes).

So node 0's launcher hosts the store itself before torchrun starts (torchrun's static
rendezvous opens its store multi-tenant and shares the server already listening in this
process), and after a successful run waits until every node has said, through the store,
that its own launcher is done; only then does the server close. Every other node says so
once its run succeeded. A run that failed skips the handshake: some node never reached the
exit barrier, and nobody waits for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

from torch.distributed import TCPStore

DONE_KEY = "hybridtrain/launchers_done"
"""Counts the launchers whose run succeeded and left torchrun."""

WAIT_SECONDS = 60.0
"""How long node 0 waits for the others after success: they have passed the exit barrier,
so they are only leaving; the bound keeps a lost node from holding node 0 forever."""


TORCHRUN_PORT = 29500
"""torchrun's ``--master-port`` when none is given."""


def static_nodes(nnodes: str, master_addr: str | None, rdzv_endpoint: str | None) -> int:
    """The node count of a static rendezvous of several nodes, else 0 (one node, or a c10d
    rendezvous, whose store host is not known by rank)."""
    nodes = int(nnodes.split(":")[-1]) if nnodes.split(":")[-1].isdigit() else 1
    return nodes if nodes > 1 and master_addr and not rdzv_endpoint else 0


def host_store(addr: str, port: int) -> TCPStore | None:
    """Node 0: listen on the rendezvous port before torchrun does, so torchrun's agent
    shares this server (it opens its store multi-tenant) and cannot close it. None when the
    port is taken: torchrun then says so itself."""
    try:
        return TCPStore(addr, port, is_master=True, wait_for_workers=False, multi_tenant=True,
                        timeout=timedelta(seconds=WAIT_SECONDS))
    except (RuntimeError, ValueError):
        return None


def wait_for_nodes(store: TCPStore, nodes: int, sleep: Callable[[float], None] = time.sleep,
                   seconds: float = WAIT_SECONDS) -> bool:
    """Node 0 after a successful run: count itself done, then wait until all ``nodes`` are
    (or ``seconds`` pass). Returns whether they all said so."""
    deadline = time.monotonic() + seconds
    done = store.add(DONE_KEY, 1)
    while done < nodes and time.monotonic() < deadline:
        sleep(0.02)
        done = store.add(DONE_KEY, 0)
    return done >= nodes


def say_done(addr: str, port: int, seconds: float = 10.0) -> bool:
    """Any other node after a successful run: tell node 0 this launcher is done. Returns
    whether node 0's store heard it (it may already have given up waiting)."""
    try:
        store = TCPStore(addr, port, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=seconds))
        store.add(DONE_KEY, 1)
        return True
    except (RuntimeError, TimeoutError):  # node 0 gone: nothing left to keep open
        return False
