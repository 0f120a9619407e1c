"""Files we write never overwrite what we read or what another run owns (issue #25's
probe: every command that writes where the user points it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hybridtrain.commands.cli import main
from hybridtrain.trainer import run_training
from tests.tiny_run import tiny_config


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("outputs") / "run"
    run_training(tiny_config(out), progress=False)
    return out


def _files(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


WRITERS: list[tuple[str, Any, str]] = [
    ("report onto its input", lambda run, tmp: ["report", str(run), "-o", str(run / "metrics.jsonl")],
     "error: -o {run}/metrics.jsonl would overwrite the input {run}/metrics.jsonl: write somewhere else"),
    ("report onto a metrics file given directly", lambda run, tmp: [
        "report", str(run / "metrics.jsonl"), "-o", str(run / "metrics.jsonl")],
     "error: -o {run}/metrics.jsonl would overwrite the input {run}/metrics.jsonl: write somewhere else"),
    ("export into a directory that holds files", lambda run, tmp: [
        "checkpoint", "export", str(run / "checkpoints" / "step-0000001"), str(run)],
     "error: export target {run} would overwrite the input {run}/checkpoints/step-0000001: write somewhere else"),
    ("export over an earlier export", lambda run, tmp: [
        "checkpoint", "export", str(run / "checkpoints" / "step-0000001"), str(tmp / "exported")],
     "error: export target {tmp}/exported already holds files (model.safetensors, …): give a new or empty "
     "directory, or --overwrite to replace them"),
    ("export into the checkpoint", lambda run, tmp: [
        "checkpoint", "export", str(run / "checkpoints" / "step-0000001"),
        str(run / "checkpoints" / "step-0000001" / "x")],
     "error: export target {run}/checkpoints/step-0000001/x would overwrite the input "
     "{run}/checkpoints/step-0000001: write somewhere else"),
    ("profile into a file", lambda run, tmp: ["profile", "--set", "device=cpu", "-o", str(run / "metrics.jsonl")],
     "error: -o {run}/metrics.jsonl is a file: give a directory for profile.json, trace.json and memory.png"),
    ("metrics file of another run", lambda run, tmp: [
        "train", "--output-dir", str(tmp / "mine"), "--steps", "1", "--set", "device=cpu"],
     "error: HYBRIDTRAIN_METRICS_FILE={run}/metrics.jsonl is in another run's directory ({run}); point it at a "
     "file of its own, or unset it"),
]


@pytest.mark.parametrize(("argv", "line"), [(a, b) for _, a, b in WRITERS], ids=[n for n, _, _ in WRITERS])
def test_no_writer_overwrites_an_input_or_another_runs_files(
        run: Path, tmp_path: Path, argv: Any, line: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDTRAIN_METRICS_FILE", str(run / "metrics.jsonl"))
    (tmp_path / "exported").mkdir()
    (tmp_path / "exported" / "model.safetensors").write_bytes(b"an earlier export")
    before = _files(run) | _files(tmp_path)
    capsys.readouterr()
    assert main(argv(run, tmp_path)) == 2
    assert capsys.readouterr().err.strip().splitlines() == [line.format(run=run, tmp=tmp_path)]
    assert _files(run) | _files(tmp_path) == before
    assert not (tmp_path / "mine").exists()  # a refused start leaves no directory behind


def test_export_with_overwrite_replaces_an_earlier_export(run: Path, tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"an earlier export")
    step = str(run / "checkpoints" / "step-0000001")
    assert main(["checkpoint", "export", step, str(tmp_path), "--overwrite"]) == 0
    assert (tmp_path / "model.safetensors").read_bytes() != b"an earlier export"
