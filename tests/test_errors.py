"""The CLI's one-line error vocabulary: which failures get a line, which exit code, which words."""

from __future__ import annotations

import errno
import os

import pytest

from hybridtrain.engine import NonFiniteLossError
from hybridtrain.errors import PeerFailure, describe_failure, peer_failure


@pytest.mark.parametrize(("exc", "line", "code"), [
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "run/metrics.jsonl"),
     "disk full writing run/metrics.jsonl: free space, or point train.output_dir at another disk", 1),
    (OSError(errno.EROFS, os.strerror(errno.EROFS), "run"),
     "cannot write run (read-only file system): choose a writable train.output_dir", 1),
    (PermissionError(errno.EACCES, os.strerror(errno.EACCES), "run"),
     "cannot write run (permission denied): choose a writable train.output_dir", 1),
    (NonFiniteLossError("loss is nan at step 7; set nonfinite_loss: skip"),
     "loss is nan at step 7; set nonfinite_loss: skip", 1),
    (ValueError("config x = 1 is not allowed:\n  detail"), "config x = 1 is not allowed: detail", 2),
])
def test_failures_a_user_can_meet_are_one_line(exc: BaseException, line: str, code: int) -> None:
    assert describe_failure(exc) == (line, code)


def test_programming_errors_keep_their_traceback() -> None:
    assert describe_failure(RuntimeError("shape mismatch")) is None
    assert describe_failure(KeyError("x")) is None


def test_a_lost_peer_and_a_stuck_one_are_told_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    lost = peer_failure(RuntimeError("[pair.cc:537] Read error [127.0.0.1]:7573: Connection reset by peer."))
    assert isinstance(lost, PeerFailure) and str(lost).startswith("lost contact with another rank in a collective")
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # no store to ask who timed out: nobody is blamed
    stuck = peer_failure(RuntimeError("[gloo] Timed out waiting 1000ms for recv operation to complete"), 1.0)
    assert str(stuck) == ("a collective did not finish within distributed.timeout_s = 1 s: every rank was waiting "
                          "(collectives called in a different order?); raise distributed.timeout_s if that rank is "
                          "only slow")
    assert peer_failure(RuntimeError("CUDA error: device-side assert")) is None
