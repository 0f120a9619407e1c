"""One self-contained HTML page comparing runs: figures as data URIs, inline CSS, no
scripts, no external resources."""

from __future__ import annotations

import datetime as _dt
import json
import math
from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import Any

from hybridtrain.outputs import check_not_an_input
from hybridtrain.report import plots
from hybridtrain.report.runs import (
    CONFIG,
    METRICS,
    SUMMARY,
    ReportError,
    Run,
    config_differences,
    flatten,
    is_missing,
    load_runs,
)

_COMPUTE_PARTS = ("forward_s", "backward_s", "forward_backward_interleaved_s")

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       margin: 24px auto; max-width: 1320px; padding: 0 16px; color: #1d2330; background: #fff; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid #e3e6eb; padding-bottom: 4px; }
.meta { color: #5a6372; font-size: 13px; margin-bottom: 12px; }
table { border-collapse: collapse; font-size: 13px; margin: 6px 0; }
th, td { border: 1px solid #e3e6eb; padding: 4px 10px; text-align: left; vertical-align: top; }
th { background: #f5f7fa; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.key, code { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, monospace; font-size: 12px; }
td.missing { color: #9aa1ad; }
.swatch { display: inline-block; width: 11px; height: 11px; border-radius: 2px;
          margin-right: 6px; vertical-align: -1px; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(620px, 1fr)); gap: 12px;
        align-items: start; }
figure { margin: 0; border: 1px solid #e3e6eb; border-radius: 6px; padding: 6px; }
figure img { width: 100%; height: auto; display: block; }
.note { color: #5a6372; font-size: 13px; }
details { margin: 6px 0; font-size: 13px; }
summary { cursor: pointer; }
"""


def build_report(run_dirs: Sequence[str | Path], title: str | None = None) -> str:
    """The HTML page comparing ``run_dirs``.

    Raises:
        ReportError: a run directory that cannot be read (one line naming the file).
        ImportError: matplotlib is not installed.
    """
    runs = load_runs(list(run_dirs))
    title = title or ("Run report: " + ", ".join(r.name for r in runs))
    loss = plots.loss_plot(runs)
    figures = [
        ("loss", "Loss and eval loss", loss),
        ("lr", "Learning rate", plots.lr_plot(runs)),
        ("throughput", "Tokens per second", plots.throughput_plot(runs)),
        ("tflops", "TFLOP/s", plots.tflops_plot(runs)),
        ("memory", plots.memory_title(runs), plots.memory_plot(runs)),
        ("loss-scale", "Loss scale", plots.loss_scale_plot(runs)),
    ]
    bars, totals = plots.timing_plots(runs)
    now = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    from hybridtrain import __version__

    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        f'<div class="meta">{len(runs)} run{"s" if len(runs) != 1 else ""} · generated {escape(now)} '
        f"by hybridtrain {escape(__version__)}</div>",
        '<h2 id="summary">Summary</h2>',
        _summary_table(runs),
        '<h2 id="curves">Curves</h2>',
        '<div class="grid">',
        *(_figure(fid, alt, uri) for fid, alt, uri in figures if uri),
        "</div>",
        '<h2 id="timing">Step-time breakdown</h2>',
    ]
    if bars:
        coarse = [r.name for r in runs if not any(k in r.timing_keys for k in _COMPUTE_PARTS)]
        parts += ['<div class="grid">', _figure("timing-parts", "Step-time breakdown", bars),
                  _figure("timing-steps", "Step time per step", totals), "</div>"]
        if coarse:
            parts.append(f'<p class="note">Forward, backward and optimizer step not recorded for '
                         f"{escape(', '.join(coarse))} (<code>wall_clock_breakdown: true</code> records "
                         "them).</p>")
    else:
        parts.append('<p class="note">No run recorded the step-time breakdown; set '
                     "<code>wall_clock_breakdown: true</code> to record forward, backward and "
                     "optimizer-step times.</p>")
    parts += ['<h2 id="config">Configuration differences</h2>', _config_section(runs),
              '<h2 id="runs">Runs</h2>', _runs_list(runs), "</body></html>"]
    return "\n".join(parts) + "\n"


def write_report(run_dirs: Sequence[str | Path], output: str | Path, title: str | None = None) -> Path:
    """Write :func:`build_report` to ``output``; returns the path.

    Raises:
        ReportError: ``output`` is one of the files read (a run's ``metrics.jsonl``, …).
    """
    read = [Path(run) / name if Path(run).is_dir() else Path(run) for run in run_dirs
            for name in (METRICS, CONFIG, SUMMARY, "")]
    try:
        check_not_an_input(output, read, "-o")
    except ValueError as exc:
        raise ReportError(str(exc)) from None
    text = build_report(run_dirs, title)
    out = Path(output)
    out.write_text(text, encoding="utf-8")
    return out


def _figure(fid: str, alt: str, uri: str | None) -> str:
    return f'<figure id="plot-{fid}"><img alt="{escape(alt)}" src="{uri}"></figure>'


def _swatch(index: int) -> str:
    return f'<span class="swatch" style="background:{plots.colour(index)}"></span>'


def _num(value: Any, digits: int = 4) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _bytes(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.1f} MiB"


def _summary_table(runs: list[Run]) -> str:
    head = ("<tr><th>run</th><th>steps</th><th>first loss</th><th>last loss</th><th>min loss</th>"
            "<th>last eval loss</th><th>tokens/s</th><th>peak memory</th><th>skipped steps</th></tr>")
    rows = []
    for i, run in enumerate(runs):
        _, losses = run.series("loss")
        finite = [v for v in losses if math.isfinite(v)]
        last_step = run.steps[-1]["step"] if run.steps else None
        summary = run.summary or {}
        tps = summary.get("tokens_per_s")
        if not isinstance(tps, (int, float)):  # no summary.json (a run still going, or killed)
            values = run.series("tokens_per_s")[1]
            tps = sum(values) / len(values) if values else None
        peaks = run.series("peak_memory_bytes")[1]
        peak = summary.get("peak_memory_bytes") or (max(peaks) if peaks else None)
        skipped = summary.get("skipped_steps", max(run.series("skipped_steps")[1], default=0))
        cells = [
            f"<td>{_swatch(i)}{escape(run.name)}</td>",
            f'<td class="num">{_num(last_step)}</td>',
            f'<td class="num">{_num(losses[0] if losses else None)}</td>',
            f'<td class="num">{_num(losses[-1] if losses else None)}</td>',
            f'<td class="num">{_num(min(finite) if finite else None)}</td>',
            f'<td class="num">{_num(run.evals[-1][1] if run.evals else None)}</td>',
            f'<td class="num">{"—" if tps is None else f"{tps:,.0f}"}</td>',
            f'<td class="num">{_bytes(peak)}</td>',
            f'<td class="num">{_num(int(skipped) if isinstance(skipped, (int, float)) else skipped)}</td>',
        ]
        rows.append("<tr>" + "".join(cells) + "</tr>")
    note = ('<p class="note">tokens/s: the run\'s whole-run average from <code>summary.json</code> '
            "(the mean of the per-step values when it has none).</p>")
    return f'<table id="summary-table">{head}{"".join(rows)}</table>{note}'


def _value(value: Any) -> str:
    if is_missing(value):
        return "(absent)"
    # Strings as they are, except the empty one (a blank cell would look like a gap).
    return escape(value if isinstance(value, str) and value else json.dumps(value))


def _config_section(runs: list[Run]) -> str:
    without = [r.name for r in runs if r.config is None]
    notes = ""
    if without:
        notes = (f'<p class="note">No <code>config.json</code> in {escape(", ".join(without))}; '
                 "left out of the comparison.</p>")
    with_config = [r for r in runs if r.config is not None]
    if len(with_config) < 2:
        body = '<p class="note">Fewer than two runs with a config: nothing to compare.</p>'
    else:
        diffs = config_differences(runs)
        if not diffs:
            body = '<p class="note">The runs\' configs are identical.</p>'
        else:
            head = "<tr><th>key</th>" + "".join(
                f"<th>{_swatch(i)}{escape(r.name)}</th>" for i, r in enumerate(runs)) + "</tr>"
            rows = []
            for key, values in diffs:
                cells = "".join(
                    f'<td class="{"missing" if is_missing(v) else "value"}">{_value(v)}</td>'
                    for v in values)
                rows.append(f'<tr><td class="key">{escape(key)}</td>{cells}</tr>')
            body = f'<table id="config-diff">{head}{"".join(rows)}</table>'
            body += (f'<p class="note">{len(diffs)} of {len({k for r in with_config for k in flatten(r.config)})} '
                     "keys differ (flattened <code>config.json</code>; keys equal in every run are not "
                     "shown).</p>")
    full = "".join(
        f"<details><summary>{_swatch(i)}full config of {escape(r.name)}</summary><table>"
        + "".join(f'<tr><td class="key">{escape(k)}</td><td>{_value(v)}</td></tr>'
                  for k, v in sorted(flatten(r.config).items()))
        + "</table></details>"
        for i, r in enumerate(runs) if r.config is not None)
    return notes + body + full


def _runs_list(runs: list[Run]) -> str:
    rows = "".join(
        f"<tr><td>{_swatch(i)}{escape(r.name)}</td><td><code>{escape(str(r.path.resolve()))}</code></td>"
        f'<td class="num">{len(r.steps)}</td><td class="num">{len(r.evals)}</td></tr>'
        for i, r in enumerate(runs))
    return ("<table><tr><th>run</th><th>directory</th><th>step records</th><th>eval records</th></tr>"
            f"{rows}</table>")
