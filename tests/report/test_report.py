"""``hybridtrain report``: two real (tiny) training runs rendered into one self-contained
HTML page; bad input is one line naming the file."""

from __future__ import annotations

import base64
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from hybridtrain.commands.cli import main
from hybridtrain.report import ReportError, build_report, config_differences, flatten, load_run

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "gpt_tiny.yaml"
PNG = b"\x89PNG\r\n\x1a\n"


class _Page(HTMLParser):
    """Tags, attributes and the text of tables, enough to check the page's structure."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.tables: dict[str, list[list[str]]] = {}
        self._table: str | None = None
        self._cell: list[str] | None = None
        self._row: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attr = dict(attrs)
        self.tags.append((tag, attr))
        if tag == "table" and attr.get("id"):
            self._table = attr["id"]
            self.tables[self._table] = []
        elif tag == "tr" and self._table:
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._row is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None and self._table:
            self.tables[self._table].append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def _parse(html: str) -> _Page:
    page = _Page()
    page.feed(html)
    return page


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two real 6-step runs of the tiny GPT differing in learning rate; the first also
    records the step-time breakdown and evaluates twice."""
    base = tmp_path_factory.mktemp("runs")
    a, b = base / "lr-3e-3", base / "lr-1e-3"
    common = ["train", str(EXAMPLE), "--steps", "6", "--no-progress", "--set", "train.eval_batches=1"]
    assert main([*common, "--output-dir", str(a), "--set", "wall_clock_breakdown=true",
                 "--set", "train.eval_every=3"]) == 0
    assert main([*common, "--output-dir", str(b), "--set", "optimizer.params.lr=1e-3"]) == 0
    return a, b


def test_report_of_two_runs_is_one_self_contained_page(two_runs: tuple[Path, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    a, b = two_runs
    out = tmp_path / "report.html"
    assert main(["report", str(a), str(b), "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    html = out.read_text(encoding="utf-8")
    page = _parse(html)

    # Plots: every curve and the step-time breakdown, embedded as real PNG images.
    figures = {attr["id"] for tag, attr in page.tags if tag == "figure"}
    assert {"plot-loss", "plot-lr", "plot-throughput", "plot-memory", "plot-timing-parts",
            "plot-timing-steps"} <= figures
    images = [attr["src"] or "" for tag, attr in page.tags if tag == "img"]
    assert len(images) == len(figures)
    for src in images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(PNG)
    assert "plot-loss-scale" not in figures  # no fp16 run: no loss-scale plot

    # Nothing is fetched from anywhere: no scripts, stylesheets, frames or URLs.
    assert not any(tag in ("script", "link", "iframe", "object", "embed") for tag, _ in page.tags)
    for tag, attr in page.tags:
        for name in ("src", "href"):
            value = attr.get(name)
            assert value is None or value.startswith(("data:", "#")), (tag, name, value[:80])
    assert not re.search(r"(?i)https?://|ftp://|url\(|@import", html)

    # Summary: one row per run, 6 steps each, first/last losses as metrics.jsonl has them.
    summary = page.tables["summary-table"]
    assert summary[0][:4] == ["run", "steps", "first loss", "last loss"]
    rows = {row[0]: row for row in summary[1:]}
    assert set(rows) == {"lr-3e-3", "lr-1e-3"}
    records = [json.loads(line) for line in (a / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert rows["lr-3e-3"][1] == "6"
    assert rows["lr-3e-3"][2] == f"{losses[0]:.4f}" and rows["lr-3e-3"][3] == f"{losses[-1]:.4f}"
    assert rows["lr-3e-3"][7].endswith("MiB") or rows["lr-3e-3"][7].endswith("GiB")

    # Config differences: the keys set differently, and only those.
    diff = {row[0]: row[1:] for row in page.tables["config-diff"][1:]}
    assert diff["optimizer.params.lr"] == ["0.003", "0.001"]
    assert diff["wall_clock_breakdown"] == ["true", "false"]
    assert diff["train.eval_every"] == ["3", "100"]
    assert "model.name" not in diff and "train.steps" not in diff


def test_bad_input_is_one_line_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    assert main(["report", str(empty), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{empty / 'metrics.jsonl'}: not found" in err

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.\n')
    assert main(["report", str(broken)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{broken / 'metrics.jsonl'} line 2: not JSON" in err

    (broken / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n[1, 2]\n')
    assert main(["report", str(broken)]) == 2
    assert "line 2: expected a JSON object" in capsys.readouterr().err

    (broken / "metrics.jsonl").write_text('{"loss": 2.0}\n')
    assert main(["report", str(broken)]) == 2
    assert "line 1: no integer 'step'" in capsys.readouterr().err

    (broken / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (broken / "config.json").write_text("{not json")
    assert main(["report", str(broken)]) == 2
    assert f"{broken / 'config.json'}: not JSON" in capsys.readouterr().err

    assert main(["report", str(tmp_path / "missing")]) == 2
    assert f"{tmp_path / 'missing'}: no such directory" in capsys.readouterr().err


def _write_run(path: Path, records: list[dict], config: dict | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


def test_records_eval_lines_and_repeated_steps(tmp_path: Path) -> None:
    run = load_run(_write_run(tmp_path / "r", [
        {"step": 1, "loss": 3.0, "lr": 0.1}, {"step": 2, "loss": 2.5, "lr": 0.1},
        {"step": 2, "eval_loss": 2.7},
        {"step": 2, "loss": 2.4, "lr": 0.1},  # a resumed attempt's record of step 2 wins
        {"step": 3, "loss": float("nan"), "lr": 0.1, "forward_s": 0.1, "data_s": 0.01, "comm_s": 0.02,
         "tokens_per_s": 10.0, "step_time_s": 0.5},
        {"step": 3, "checkpoint_s": 1.5, "checkpoint_bytes": 1000},  # merges into step 3
    ]))
    assert [r["step"] for r in run.steps] == [1, 2, 3]
    assert run.series("loss")[1][1] == 2.4
    assert run.steps[2]["checkpoint_bytes"] == 1000 and run.steps[2]["lr"] == 0.1
    assert run.evals == [(2, 2.7)]
    # Parts of a step: not the whole step's time, not checkpoints, not rates.
    assert run.timing_keys == ["data_s", "forward_s", "comm_s"]
    html = build_report([run.path])
    assert "nan" in html and "Fewer than two runs with a config" in html


def test_config_differences_flatten_and_compare() -> None:
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": {}, "e": None}) == {"a.b": 1, "a.c": [1, 2], "d": {},
                                                                      "e": None}

    class R:  # the one attribute config_differences reads
        def __init__(self, config: dict | None) -> None:
            self.config = config

    rows = dict(config_differences([R({"x": 1.0, "y": {"z": 1}, "w": [1]}),  # type: ignore[list-item]
                                    R({"x": 1, "y": {"z": 2}}), R(None)]))
    assert set(rows) == {"y.z", "w"}  # 1.0 == 1; the run without config is left out
    assert rows["y.z"][:2] == [1, 2]


def test_names_are_escaped_and_clashing_names_disambiguated(tmp_path: Path) -> None:
    a = _write_run(tmp_path / "x" / "<b>run", [{"step": 1, "loss": 1.0}], {"k": 1})
    b = _write_run(tmp_path / "y" / "<b>run", [{"step": 1, "loss": 2.0}], {"k": 2})
    html = build_report([a, b])
    assert "<b>run" not in html and "&lt;b&gt;run" in html
    assert str(tmp_path / "x") in html and str(tmp_path / "y") in html
    with pytest.raises(ReportError, match="no such directory"):
        build_report([tmp_path / "nope"])
