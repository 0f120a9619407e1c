"""CLI smoke tests: help, a short training run, exact resume, signals, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gpt_tiny.yaml"


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hybridtrain.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_help_documents_every_option() -> None:
    top = _cli("--help")
    assert top.returncode == 0 and "train" in top.stdout and "hpo" in top.stdout
    train = _cli("train", "--help")
    for option in ("--set", "--resume", "--output-dir", "--steps", "--data", "--no-progress"):
        assert option in train.stdout
    reference = _cli("config", "--reference")
    assert "`gradient_accumulation_steps`" in reference.stdout


def test_train_writes_metrics_checkpoints_and_summary(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env_metrics = tmp_path / "hpo-metrics.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "hybridtrain.cli", "train", str(EXAMPLE), "--steps", "4", "--output-dir", str(out),
         "--set", "steps_per_print=2", "--set", "train.eval_batches=1"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, "HYBRIDTRAIN_METRICS_FILE": str(env_metrics)},
    )
    assert proc.returncode == 0, proc.stderr
    assert "step=2 loss=" in proc.stdout and "step=4 eval_loss=" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("loss=")
    assert "summary: steps 0→4" in proc.stdout
    records = _metrics(out)
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert env_metrics.read_text() == (out / "metrics.jsonl").read_text()
    assert (out / "checkpoints" / "step-0000004" / "meta.json").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["last_loss"] < summary["first_loss"] + 1.0


def test_resume_continues_with_the_uninterrupted_losses(tmp_path: Path) -> None:
    common = [str(EXAMPLE), "--set", "train.checkpoint_every=3", "--set", "train.eval_batches=1", "--no-progress"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert _cli("train", *common, "--steps", "6", "--output-dir", str(full)).returncode == 0
    assert _cli("train", *common, "--steps", "3", "--output-dir", str(part)).returncode == 0
    resumed = _cli("train", *common, "--steps", "6", "--output-dir", str(part), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "continuing from" in resumed.stderr
    losses = lambda out: [r["loss"] for r in _metrics(out) if "loss" in r]  # noqa: E731
    assert losses(part) == losses(full)


def test_sigterm_saves_a_checkpoint_and_resume_finishes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = [sys.executable, "-m", "hybridtrain.cli", "train", str(EXAMPLE), "--steps", "100000", "--output-dir",
            str(out), "--no-progress", "--set", "train.eval_batches=1"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 90
    while time.time() < deadline and not (out / "metrics.jsonl").exists():
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, err
    saved = sorted((out / "checkpoints").glob("step-*"))
    assert saved, err
    step = int(saved[-1].name.split("-")[1])
    resumed = _cli("train", str(EXAMPLE), "--steps", str(step + 2), "--output-dir", str(out), "--resume",
                   "--set", "train.eval_batches=1")
    assert resumed.returncode == 0, resumed.stderr
    assert [r["step"] for r in _metrics(out) if "loss" in r][-3:] == [step, step + 1, step + 2]


@pytest.mark.parametrize(("args", "needle"), [
    (["--set", "gradient_acumulation_steps=2"], "did you mean 'gradient_accumulation_steps'"),
    (["--set", "model.name=gpt-huge"], "model.name 'gpt-huge' is unknown"),
    (["--data", "/nonexistent.txt"], "does not exist"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], needle: str, tmp_path: Path) -> None:
    proc = _cli("train", str(EXAMPLE), "--output-dir", str(tmp_path), *args)
    assert proc.returncode == 2
    assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
