"""Node 0 keeps the rendezvous store up until every node's launcher is done
(:mod:`hybridtrain.parallel.exit_handshake`)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from torch.distributed import TCPStore

from hybridtrain.parallel import exit_handshake
from tests.parallel.spawn import free_port

# Node 1 reaches the exit barrier last: it writes the barrier's key, then waits on it, while
# node 0 is woken by that key and leaves.
LAST_NODE_ONE = """
import time
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
dist.barrier()
dist.destroy_process_group()
if rank == 1:
    time.sleep(1.0)
print(f"rank {rank} done", flush=True)
"""


def test_only_a_static_rendezvous_of_several_nodes_takes_part() -> None:
    assert exit_handshake.static_nodes("2", "10.0.0.1", None) == 2
    assert exit_handshake.static_nodes("3:3", "10.0.0.1", None) == 3
    assert exit_handshake.static_nodes("1", "10.0.0.1", None) == 0
    assert exit_handshake.static_nodes("2", None, None) == 0
    assert exit_handshake.static_nodes("1:4", None, "h:29400") == 0


def test_torchruns_store_shares_node_0s_server_and_closing_it_keeps_the_server() -> None:
    port = free_port()
    kept = exit_handshake.host_store("127.0.0.1", port)
    assert kept is not None
    # What torchrun's static rendezvous opens on node 0: a multi-tenant master store.
    agents = TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=10), multi_tenant=True)
    agents.set("barrier/last", "1")
    del agents  # torchrun returned on node 0
    reader = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
    assert reader.get("barrier/last") == b"1"


def test_node_0_waits_until_every_node_says_it_is_done() -> None:
    port = free_port()
    store = exit_handshake.host_store("127.0.0.1", port)
    assert store is not None
    told = []
    late = threading.Timer(0.5, lambda: told.append(exit_handshake.say_done("127.0.0.1", port)))
    start = time.monotonic()
    late.start()
    assert exit_handshake.wait_for_nodes(store, 2)
    assert time.monotonic() - start >= 0.45 and told == [True]
    # A node that never says it (lost after the barrier) holds node 0 only for the bound.
    assert not exit_handshake.wait_for_nodes(store, 4, seconds=0.2)


def test_a_taken_port_leaves_the_error_to_torchrun() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert exit_handshake.host_store("127.0.0.1", taken.getsockname()[1]) is None
    # Nobody listening: a late node gives up without raising.
    assert exit_handshake.say_done("127.0.0.1", free_port(), seconds=0.5) is False


def test_two_nodes_with_node_1_last_end_cleanly(tmp_path: Path) -> None:
    script = tmp_path / "last.py"
    script.write_text(LAST_NODE_ONE)
    port = str(free_port())

    def node(rank: int) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "hybridtrain", "launch", "--nnodes", "2", "--node-rank", str(rank),
             "--master-addr", "127.0.0.1", "--master-port", port, "--nproc-per-node", "1", str(script)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    nodes = [node(0), node(1)]
    logs = [n.communicate(timeout=120)[0] for n in nodes]
    ended = [n.returncode for n in nodes]
    assert ended == [0, 0], logs
    assert "rank 0 done" in logs[0] and "rank 1 done" in logs[1], logs
    for log in logs:
        assert "exit barrier" not in log and "Exception raised from" not in log, log
