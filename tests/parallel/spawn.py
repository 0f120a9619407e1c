"""The one helper every distributed test uses: run a function on N gloo ranks on loopback.

Each rank is a fresh ``spawn``-ed process (fork after torch has started its thread pools
can deadlock) with the environment ``torchrun`` would give it, so the code under test
initialises ``torch.distributed`` exactly as in production. The parent polls the ranks:
a rank that raises fails the test at once with that rank's traceback (the others are
killed instead of waiting in a collective), and a run past ``timeout`` fails naming the
ranks still alive — a hang can never block the suite.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from hybridtrain.parallel.mesh import end_process_group


class RankFailed(AssertionError):
    """A rank raised; the message holds its rank number and traceback."""


def free_port() -> int:
    """A TCP port on loopback that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 90.0,
              env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks; return each rank's result, in rank order.

    Raises:
        RankFailed: a rank raised or died (message names the first failing rank).
        TimeoutError: ranks still running after ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ht-ranks-") as tmp:
        procs = [ctx.Process(target=_rank_main, args=(fn, rank, world_size, port, tmp, args, env or {}),
                             daemon=True) for rank in range(world_size)]
        for proc in procs:
            proc.start()
        try:
            _wait(procs, Path(tmp), timeout)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join(5)
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _wait(procs: list[Any], tmp: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        for rank, proc in enumerate(procs):
            if proc.exitcode not in (None, 0):
                err = tmp / f"rank{rank}.err"
                detail = err.read_text() if err.exists() else f"exit code {proc.exitcode} (killed?)"
                raise RankFailed(f"rank {rank} failed:\n{detail}")
        if all(proc.exitcode == 0 for proc in procs):
            return
        if time.monotonic() > deadline:
            alive = [r for r, p in enumerate(procs) if p.exitcode is None]
            raise TimeoutError(f"ranks {alive} still running after {timeout:.0f}s (a hang?)")
        time.sleep(0.02)


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, tmp: str,
               args: tuple[Any, ...], env: dict[str, str]) -> None:
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
        **env,
    })
    # Several ranks share two cores: one thread each avoids oversubscription stalls.
    torch.set_num_threads(1)
    try:
        result = fn(*args)
        torch.save(result, Path(tmp) / f"rank{rank}.pt")
    except BaseException:
        (Path(tmp) / f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    # Every rank leaves the group together, as a finished run does. Then the rank exits
    # without the interpreter's teardown: gloo objects still referenced there (device
    # meshes, the engine's groups) are destroyed while the interpreter is half gone, and a
    # rank now and then died of SIGABRT ("terminate called without an active exception")
    # after its result was saved (1 in 105 runs of a two-rank pipeline test here, and one
    # of three whole-suite runs), failing a test whose training was right.
    end_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
