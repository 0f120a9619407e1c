"""``hpo report``: plots of an experiment as PNG files or one self-contained HTML page.

Drawn with Optuna's matplotlib backend; the HTML page embeds the same PNGs, so neither
format needs plotly or a network connection to view.
"""

from __future__ import annotations

import base64
import html
import io
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridtrain.hpo.errors import HPOError

if TYPE_CHECKING:
    import optuna


def _plotters() -> dict[str, Callable[[optuna.Study], Any]]:
    from optuna.visualization import matplotlib as vis

    return {
        "optimization_history": vis.plot_optimization_history,
        "parallel_coordinate": vis.plot_parallel_coordinate,
        "param_importances": vis.plot_param_importances,
        "intermediate_values": vis.plot_intermediate_values,
    }


def render_pngs(study: optuna.Study) -> tuple[dict[str, bytes], dict[str, str]]:
    """Draw every plot of ``study``.

    Returns:
        ``(pngs, skipped)``: PNG bytes by plot name, and for plots that cannot be drawn
        yet (e.g. importances with fewer than two completed trials) the reason.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    pngs: dict[str, bytes] = {}
    skipped: dict[str, str] = {}
    for name, plot in _plotters().items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Optuna marks these plots experimental
                ax = plot(study)
        except (ValueError, RuntimeError) as exc:
            skipped[name] = str(exc).splitlines()[0]
            continue
        fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
        fig.set_size_inches(8, 5)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
        plt.close(fig)
        pngs[name] = buf.getvalue()
    return pngs, skipped


def _html(study: optuna.Study, pngs: dict[str, bytes], skipped: dict[str, str]) -> str:
    try:
        best = study.best_trial
        summary = (f"best trial {best.number}: value={best.value:.6g} params="
                   f"{html.escape(json.dumps(best.params, default=str))}")
    except ValueError:
        summary = "no completed trial yet"
    parts = [f"<h1>{html.escape(study.study_name)}</h1><p>{summary}</p>"]
    for name, png in pngs.items():
        data = base64.b64encode(png).decode()
        parts.append(f"<h2>{name.replace('_', ' ')}</h2><img src='data:image/png;base64,{data}'>")
    for name, reason in skipped.items():
        parts.append(f"<h2>{name.replace('_', ' ')}</h2><p>not drawn: {html.escape(reason)}</p>")
    return ("<!doctype html><html><head><meta charset='utf-8'><title>"
            f"{html.escape(study.study_name)}</title></head><body>{''.join(parts)}</body></html>")


def write_report(study: optuna.Study, out: Path, fmt: str = "png") -> list[Path]:
    """Write the plots of ``study`` into directory ``out``.

    Args:
        study: the experiment's study.
        out: output directory (created).
        fmt: ``png`` (one file per plot) or ``html`` (one ``report.html``).

    Returns:
        The files written.

    Raises:
        HPOError: ``fmt`` is unknown, or the study has no finished trial to plot.
    """
    if fmt not in ("png", "html"):
        raise HPOError(f"report format {fmt!r} is not supported; use png or html")
    if not any(t.state.is_finished() for t in study.get_trials(deepcopy=False)):
        raise HPOError(f"experiment {study.study_name!r} has no finished trial to plot yet")
    pngs, skipped = render_pngs(study)
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "html":
        path = out / "report.html"
        path.write_text(_html(study, pngs, skipped))
        return [path]
    written = []
    for name, png in pngs.items():
        path = out / f"{name}.png"
        path.write_bytes(png)
        written.append(path)
    return written
