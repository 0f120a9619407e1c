"""The report's memory figure says what it plots (a CPU run has no device memory: its
figure is the process's peak RSS), and without matplotlib the report is one line naming
the extra to install."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hybridtrain.report import load_run
from hybridtrain.report.plots import memory_title


def _run(path: Path, device: str | None, cuda_records: bool) -> Path:
    path.mkdir(parents=True)
    extra = {"memory_allocated_bytes": 1 << 20, "memory_reserved_bytes": 2 << 20} if cuda_records else {}
    records = [{"step": s, "loss": 3.0 - s / 10, "peak_memory_bytes": (100 + s) << 20, **extra} for s in (1, 2, 3)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if device is not None:
        (path / "summary.json").write_text(json.dumps({"steps": 3, "device": device}))
    return path


def test_the_memory_figure_is_titled_by_what_it_plots(tmp_path: Path) -> None:
    cpu = load_run(_run(tmp_path / "cpu", "cpu", cuda_records=False))
    gpu = load_run(_run(tmp_path / "gpu", "cuda:0", cuda_records=True))
    unsummarised_cpu = load_run(_run(tmp_path / "old-cpu", None, cuda_records=False))
    assert memory_title([cpu]) == memory_title([unsummarised_cpu]) == (
        "Process memory (peak RSS: CPU runs have no device memory)")
    assert memory_title([gpu]) == "Device memory"
    assert "peak RSS for CPU runs" in memory_title([cpu, gpu])


def test_the_page_heads_a_cpu_runs_memory_figure_as_rss(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from hybridtrain.report import build_report

    html = build_report([_run(tmp_path / "cpu", "cpu", cuda_records=False)])
    assert "Process memory (peak RSS" in html and "Device memory" not in html


def test_without_matplotlib_the_report_is_one_line_naming_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from hybridtrain.commands.cli import main

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] or ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # an import of it raises ImportError
    run = _run(tmp_path / "cpu", "cpu", cuda_records=False)
    assert main(["report", str(run), "-o", str(tmp_path / "r.html")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: hybridtrain report draws its figures with matplotlib, which is not installed; "
        "pip install 'hybridtrain[report]'"]
