"""``hybridtrain launch``'s per-rank trampoline: the script runs as ``__main__`` and an
uncaught exception lands in torchrun's error file, a lost peer as PeerFailure."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hybridtrain.parallel.worker import main, record_failure


@pytest.mark.parametrize(("raised", "recorded"), [
    ("ValueError('bad batch')", "ValueError: bad batch"),
    ("RuntimeError('[pair.cc:537] Read error [127.0.0.1]:7573: Connection reset by peer')",
     "PeerFailure: lost contact with another rank in a collective"),
])
def test_an_uncaught_exception_is_recorded_for_the_launcher(raised: str, recorded: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "train.py"
    script.write_text(f"import sys\nassert __name__ == '__main__' and sys.argv[1:] == ['--x']\nraise {raised}\n")
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(Exception):  # noqa: B017 - re-raised as it was (traceback, exit code 1)
        main([str(script), "--x"])
    assert json.loads(error_file.read_text())["message"]["message"].startswith(recorded)


def test_sys_exit_is_not_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "quit.py"
    script.write_text("import sys\nsys.exit(3)\n")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(SystemExit, match="3"):
        main([str(script)])
    assert not (tmp_path / "error.json").exists()


def test_the_launcher_reads_what_a_rank_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    record_failure(ValueError("train.steps: -1 must be >= 1"))
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    assert failure.message["message"] == "ValueError: train.steps: -1 must be >= 1"
    assert failure.timestamp > 0
    assert list(tmp_path.iterdir()) == [error_file]


def test_a_rank_stopped_while_recording_leaves_no_half_written_file(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # torchrun's agent SIGTERMs the surviving ranks, then parses their error files: an empty
    # one (truncated, not yet written) made it exit without restarting the group.
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))

    def stopped(*_: object, **__: object) -> None:
        raise KeyboardInterrupt  # the signal, arriving mid-write

    monkeypatch.setattr(json, "dump", stopped)
    with pytest.raises(KeyboardInterrupt):
        record_failure(RuntimeError("lost contact with another rank"))
    assert list(tmp_path.iterdir()) == []
