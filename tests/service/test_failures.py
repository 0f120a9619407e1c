"""A failed attempt's reason names what happened, from the exit code and the output lines
hybridtrain's own commands print (the trainer's ``error:`` line, the launcher's rank)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridtrain.service.failures import describe_exit


@pytest.mark.parametrize(("code", "lines", "reason", "restartable"), [
    (1, ["step=3 loss=2.1", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"],
     "OOM: torch.OutOfMemoryError: CUDA out of memory", True),
    (137, ["step=3 loss=2.1"], "killed by SIGKILL (the kernel's OOM killer, or kill -9)", True),
    (1, ["error: rank 1 (local rank 1, pid 4242) exited with code 1; the launcher stopped the "
         "other ranks"], "a rank failed (exit 1): error: rank 1 (local rank 1", True),
    (2, ["error: config train.steps = -1: must be >= 0"],
     "bad config or arguments (exit 2): error: config train.steps = -1", False),
    (3, ["--- attempt 1 on cpu [0] ---", "something broke"], "exit code 3: something broke", True),
    (None, [], "ended without an exit code", True),
])
def test_reasons(tmp_path: Path, code: int | None, lines: list[str], reason: str,
                 restartable: bool) -> None:
    log = tmp_path / "output.log"
    log.write_text("\n".join(lines) + "\n")
    got, again = describe_exit(code, log)
    assert got.startswith(reason) and again is restartable, got
