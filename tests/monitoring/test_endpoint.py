"""A CPU ``hybridtrain train --metrics-port`` run: /metrics answers within seconds, during
the run and after it (linger), and every value agrees with metrics.jsonl; TensorBoard and
CSV files of the same run read back with the same values."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hybridtrain.monitoring.metric_names import METRICS
from tests.monitoring.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]

# metrics.jsonl field → (series, label) shown for it.
AGREE = {"step": ("hybridtrain_step", None), "loss": ("hybridtrain_loss", None),
         "lr": ("hybridtrain_learning_rate", None), "tokens_per_s": ("hybridtrain_tokens_per_second", None),
         "samples_per_s": ("hybridtrain_samples_per_second", None), "tflops": ("hybridtrain_tflops", None),
         "forward_s": ("hybridtrain_step_seconds", "forward"), "backward_s": ("hybridtrain_step_seconds", "backward"),
         "step_s": ("hybridtrain_step_seconds", "optimizer"), "data_s": ("hybridtrain_step_seconds", "data"),
         "step_time_s": ("hybridtrain_step_seconds", "total"),
         "peak_memory_bytes": ("hybridtrain_device_memory_bytes", "peak")}


def scrape(port: int) -> dict[tuple[str, str | None], float] | None:
    """(series name, part/kind label) → value, or None when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return None
    values: dict[tuple[str, str | None], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels["rank"] == "0"
            values[(sample.name, sample.labels.get("part") or sample.labels.get("kind"))] = sample.value
    return values


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_cli_run_serves_metrics_that_agree_with_metrics_jsonl(tmp_path: Path) -> None:
    out, port = tmp_path / "run", free_port()
    cmd = [sys.executable, "-m", "hybridtrain", "train", "--steps", "6", "--output-dir", str(out),
           "--metrics-port", str(port), "--no-progress",
           "--set", "model.overrides.n_layer=1", "--set", "data.seq_len=32", "--set", "train_batch_size=4",
           "--set", "device=cpu", "--set", "wall_clock_breakdown=true", "--set", "train.eval_every=3",
           "--set", "train.eval_batches=1", "--set", "train.checkpoint_every=2",
           "--set", "train.metrics_linger_s=120",
           "--set", "tensorboard.enabled=true", "--set", "csv_monitor.enabled=true",
           "--set", "csv_monitor.job_name=csv"]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    # stderr is read as it comes: SIGTERM must wait until the job says it lingers (sent
    # earlier, between the end of training and the linger, it would end the job unhandled).
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        first_answer: float | None = None
        during: list[dict[tuple[str, str | None], float]] = []
        final: dict[tuple[str, str | None], float] | None = None
        while time.monotonic() - started < 90 and proc.poll() is None:
            values = scrape(port)
            if values is not None:
                first_answer = first_answer or time.monotonic() - started
                if (out / "summary.json").exists():  # training is over; the job lingers
                    final = scrape(port)
                    break
                during.append(values)
            time.sleep(0.02)
        assert final is not None, "".join(lines) if proc.poll() is not None else "no final scrape"
        while proc.poll() is None and not any("still serving" in line for line in lines):
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGTERM)  # ends the linger
        proc.wait(timeout=60)
        proc.stdout.read()  # type: ignore[union-attr]  (a few lines: the pipe never filled)
        reader.join(timeout=10)
        stderr = "".join(lines)
    assert proc.returncode == 0, stderr
    assert f"metrics: serving http://127.0.0.1:{port}/metrics" in stderr
    assert first_answer is not None and first_answer < 30  # (dominated by importing torch)
    # Answered before the end (before the model is built, the page has only resting values).
    assert during and min(v.get(("hybridtrain_step", None), 0) for v in during) < 6

    rows = records(out)
    by_step = {r["step"]: r for r in rows if "loss" in r}
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    saves = [r for r in rows if "checkpoint_bytes" in r]
    # Every scrape shows the numbers of one metrics.jsonl step record (or the start, step 0).
    for values in [*during, final]:
        step = int(values.get(("hybridtrain_step", None), 0))
        if step == 0:
            continue
        for field, key in AGREE.items():
            assert values[key] == by_step[step][field], (step, field)
    # The final page: the last step, the last evaluation and checkpoint, ≥ 15 names.
    assert final[("hybridtrain_step", None)] == 6
    assert final[("hybridtrain_eval_loss", None)] == evals[6]
    assert final[("hybridtrain_checkpoint_bytes", None)] == saves[-1]["checkpoint_bytes"] > 0
    assert final[("hybridtrain_checkpoint_seconds", None)] == saves[-1]["checkpoint_s"]
    assert final[("hybridtrain_skipped_steps_total", None)] == 0
    assert final[("hybridtrain_loss_scale", None)] == 1.0
    assert final[("hybridtrain_restarts_total", None)] == 0
    names = {name.removesuffix("_total") for name, _ in final}
    assert names <= {n.removesuffix("_total") for n in METRICS}
    assert len(names) >= 15, sorted(names)
    assert ("hybridtrain_mfu", None) not in final  # CPU: no known peak

    # TensorBoard: our names by step, DeepSpeed's by samples seen (4 per step).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(out / "DeepSpeedJobName"))
    tb.Reload()
    loss = tb.Scalars("hybridtrain/loss")
    assert [e.step for e in loss] == list(range(1, 7))
    assert all(math.isclose(e.value, by_step[e.step]["loss"], rel_tol=1e-6) for e in loss)
    ds_loss = tb.Scalars("Train/Samples/train_loss")
    assert [e.step for e in ds_loss] == [4 * s for s in range(1, 7)]
    assert all(math.isclose(e.value, by_step[e.step // 4]["loss"], rel_tol=1e-6) for e in ds_loss)
    assert [e.value for e in tb.Scalars("Train/Samples/lr")] == pytest.approx([by_step[s]["lr"] for s in range(1, 7)])
    assert [e.step for e in tb.Scalars("hybridtrain/eval_loss")] == [3, 6]

    # CSV: DeepSpeed's layout, one file per metric.
    with open(out / "csv" / "Train_Samples_train_loss.csv", newline="") as fh:
        table = list(csv.reader(fh))
    assert table[0] == ["step", "train_loss"]
    assert [(int(s), float(v)) for s, v in table[1:]] == [(4 * s, by_step[s]["loss"]) for s in range(1, 7)]
    with open(out / "csv" / "hybridtrain_lr.csv", newline="") as fh:
        table = list(csv.reader(fh))
    assert table[0] == ["step", "lr"] and [float(v) for _, v in table[1:]] == [by_step[s]["lr"] for s in range(1, 7)]
