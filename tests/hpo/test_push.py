"""The push API for Python trials."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import hybridtrain.hpo as hpo
from hybridtrain.hpo.metrics import MetricsCollector
from hybridtrain.hpo.push import METRICS_FILE_ENV


def test_report_appends_jsonl_the_collector_reads(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "metrics.jsonl"
    monkeypatch.setenv(METRICS_FILE_ENV, str(path))
    hpo.report(loss=0.5, step=1)
    hpo.report(loss=0.25, accuracy=0.9)
    hpo.report(loss=float("nan"), step=7)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == {"step": 1, "loss": 0.5}
    assert lines[2] == {"step": 7, "loss": "nan"}
    c = MetricsCollector(tmp_path / "stdout.log", path)
    c.poll(final=True)
    assert c.series("loss") == {1: 0.5, 2: 0.25}


def test_report_prints_katib_line_outside_a_trial(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(METRICS_FILE_ENV, raising=False)
    hpo.report(loss=1e-3, step=3)
    assert capsys.readouterr().out == "step=3 loss=0.001\n"


def test_report_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="at least one metric"):
        hpo.report()
    with pytest.raises(ValueError, match="'loss' must be a number"):
        hpo.report(loss="low")  # type: ignore[arg-type]
