"""The metrics collector on real-looking logs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridtrain.hpo.metrics import MetricsCollector, parse_line

TRAIN_LOG = """\
[2024-05-01 10:00:00] INFO building model gpt-tiny (n_layer=2, lr=0.001 from config)
Running: hybridtrain train cfg.yaml --set optimizer.params.lr=1e-3 --lr=0.5
step=10 loss=3.2154 lr=0.001 tokens_per_s=1234.5
epoch 1/3 | step=20 | loss=2.9e+00 | accuracy=0.51 | grad_norm = 1.25E-1
Traceback-free warning: loss went up, see https://x.org/a?loss=9
step=30 loss=nan lr=0.001
done. loss=2.7512 eval_loss=2.80
"""


def test_parse_line_katib_format() -> None:
    assert parse_line("step=10 loss=3.2154 lr=0.001 tokens_per_s=1234.5") == (
        {"loss": 3.2154, "lr": 0.001, "tokens_per_s": 1234.5}, 10)
    metrics, step = parse_line("epoch 1/3 | step=20 | loss=2.9e+00 | grad_norm = 1.25E-1")
    assert (metrics, step) == ({"loss": 2.9, "grad_norm": 0.125}, 20)
    # Flags, URLs and words glued to values are not metrics.
    assert parse_line("args: --lr=0.5 url=https://x.org/?loss=9 id=12ab") == ({}, None)
    assert parse_line("no metrics here") == ({}, None)
    assert parse_line("val/acc=-.5")[0] == {"val/acc": -0.5}
    # A value may end a sentence, but a version or an address is no number.
    assert parse_line("Validation done: loss=0.25.") == ({"loss": 0.25}, None)
    assert parse_line("torch version=2.3.1 host ip=10.0.0.1 lr=1e-3x") == ({}, None)


def test_collector_on_training_log(tmp_path: Path) -> None:
    out = tmp_path / "stdout.log"
    out.write_text(TRAIN_LOG)
    c = MetricsCollector(out, tmp_path / "metrics.jsonl")
    obs = c.poll(final=True)
    loss = {o.step: o.value for o in obs if o.metric == "loss"}
    assert list(loss)[:2] == [10, 20]
    assert loss[31] == 2.7512  # the step-less summary comes after the last step
    assert c.latest["eval_loss"] == 2.80
    assert "optimizer.params.lr" in c.latest  # an echoed --set is just another name
    assert c.final_value("loss", "latest") == 2.7512
    assert c.final_value("loss", "max") == 3.2154
    assert c.final_value("missing", "latest") is None


def test_collector_reads_incrementally_and_waits_for_whole_lines(tmp_path: Path) -> None:
    out = tmp_path / "stdout.log"
    c = MetricsCollector(out, tmp_path / "metrics.jsonl")
    assert c.poll() == []  # nothing written yet
    with out.open("a") as f:
        f.write("step=1 loss=5\nstep=2 lo")
    assert [(o.step, o.value) for o in c.poll()] == [(1, 5.0)]
    with out.open("a") as f:
        f.write("ss=4\nstep=3 loss=3")
    assert [(o.step, o.value) for o in c.poll()] == [(2, 4.0)]
    # The unterminated last line counts once the trial has exited.
    assert [(o.step, o.value) for o in c.poll(final=True)] == [(3, 3.0)]


def test_stdout_and_jsonl_of_the_same_run_are_not_double_counted(tmp_path: Path) -> None:
    out, jsonl = tmp_path / "stdout.log", tmp_path / "metrics.jsonl"
    out.write_text("step=2 loss=2.5 lr=0.1\nstep=4 loss=2.0 lr=0.1\nfinal loss=2.0\n")
    jsonl.write_text("".join(json.dumps({"step": s, "loss": 3.0 - s / 4, "lr": 0.1}) + "\n"
                             for s in range(1, 5)) + json.dumps({"step": 4, "eval_loss": 2.2})
                     + "\n")
    c = MetricsCollector(out, jsonl)
    obs = c.poll(final=True)
    steps = [o.step for o in obs if o.metric == "loss"]
    assert sorted(steps) == [1, 2, 3, 4, 5]
    assert len(steps) == len(set(steps))
    assert c.series("eval_loss") == {4: 2.2}


@pytest.mark.parametrize(("strategy", "expected"), [("latest", 2.0), ("min", 1.0),
                                                     ("max", 3.0)])
def test_strategies(tmp_path: Path, strategy: str, expected: float) -> None:
    out = tmp_path / "stdout.log"
    out.write_text("step=3 loss=2\nstep=1 loss=3\nstep=2 loss=1\n")
    c = MetricsCollector(out, tmp_path / "none.jsonl")
    c.poll(final=True)
    assert c.final_value("loss", strategy) == expected


def test_collector_follows_a_file_rewritten_shorter(tmp_path: Path) -> None:
    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text("".join(json.dumps({"step": s, "loss": 10.0 - s}) + "\n"
                             for s in range(1, 6)))
    c = MetricsCollector(tmp_path / "stdout.log", jsonl)
    assert len(c.poll()) == 5
    # A resumed run drops the records after its checkpoint (step 2) and goes on from there.
    jsonl.write_text("".join(json.dumps({"step": s, "loss": 10.0 - s}) + "\n"
                             for s in (1, 2, 6)))
    assert [(o.step, o.value) for o in c.poll()] == [(6, 4.0)]
