"""The report's figures: matplotlib (Agg backend), returned as base64 PNG data URIs so the
page needs nothing but itself."""

from __future__ import annotations

import base64
import io
import statistics
from typing import TYPE_CHECKING, Any

from hybridtrain.report.runs import STEP_TIME, TIMING_KEYS, Run

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# One colour per run, the same in every figure and in the tables' swatches.
PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf"]
_PART_COLOURS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3"]


def colour(index: int) -> str:
    return PALETTE[index % len(PALETTE)]


def _figure(width: float = 6.4, height: float = 3.6) -> Figure:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    return fig


def _png(fig: Figure) -> str:
    buf = io.BytesIO()
    # No "Software" text chunk: the page should not name any URL, not even inside an image.
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _style(ax: Any, title: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=11, loc="left")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)


def _line_plot(runs: list[Run], key: str, title: str, ylabel: str, scale: float = 1.0,
               log: bool = False) -> str | None:
    if not any(r.has(key) for r in runs):
        return None
    fig = _figure()
    ax = fig.add_subplot()
    for i, run in enumerate(runs):
        xs, ys = run.series(key)
        if xs:
            ax.plot(xs, [y / scale for y in ys], color=colour(i), label=run.name, lw=1.6,
                    marker="o" if len(xs) <= 30 else None, ms=3)
    if log and all(y > 0 for r in runs for y in r.series(key)[1]):
        ax.set_yscale("log")
    _style(ax, title, ylabel)
    if len(runs) > 1:
        ax.legend(fontsize=8, frameon=False)
    return _png(fig)


def loss_plot(runs: list[Run]) -> str | None:
    """Training loss (lines) and eval loss (dashed, square markers) of every run."""
    if not any(r.has("loss") or r.evals for r in runs):
        return None
    fig = _figure()
    ax = fig.add_subplot()
    for i, run in enumerate(runs):
        xs, ys = run.series("loss")
        if xs:
            ax.plot(xs, ys, color=colour(i), lw=1.6, label=f"{run.name} train",
                    marker="o" if len(xs) <= 30 else None, ms=3)
        if run.evals:
            ex, ey = zip(*run.evals, strict=True)
            ax.plot(ex, ey, color=colour(i), lw=1.2, ls="--", marker="s", ms=5,
                    label=f"{run.name} eval")
    _style(ax, "Loss (solid: train, dashed: eval)", "loss")
    ax.legend(fontsize=8, frameon=False)
    return _png(fig)


def lr_plot(runs: list[Run]) -> str | None:
    return _line_plot(runs, "lr", "Learning rate", "lr")


def throughput_plot(runs: list[Run]) -> str | None:
    return _line_plot(runs, "tokens_per_s", "Throughput", "tokens/s")


def on_cpu(run: Run) -> bool:
    """Whether ``run`` trained on the CPU, where ``peak_memory_bytes`` is the process's peak
    resident set size (everything it touched), not a device's memory. Its summary says the
    device; without one, CUDA records always carry the allocator's ``memory_allocated_bytes``."""
    device = (run.summary or {}).get("device")
    if isinstance(device, str):
        return device.startswith("cpu")
    return not run.has("memory_allocated_bytes")


def memory_title(runs: list[Run]) -> str:
    """What the memory figure shows: device memory, the process's peak RSS on CPU, or both."""
    cpu = [on_cpu(r) for r in runs]
    if all(cpu):
        return "Process memory (peak RSS: CPU runs have no device memory)"
    return "Device memory" if not any(cpu) else "Memory: device peak allocated; process peak RSS for CPU runs"


def memory_plot(runs: list[Run]) -> str | None:
    """Peak device memory (solid; a CPU run's process peak RSS); reserved (dashed) and
    allocated (dotted) where recorded."""
    keys = [("peak_memory_bytes", "-", "peak"), ("memory_reserved_bytes", "--", "reserved"),
            ("memory_allocated_bytes", ":", "allocated")]
    if not any(r.has(k) for r in runs for k, _, _ in keys):
        return None
    peak = max((y for r in runs for k, _, _ in keys for y in r.series(k)[1]), default=0.0)
    unit, scale = ("GiB", 2.0**30) if peak >= 2**30 else ("MiB", 2.0**20)
    fig = _figure()
    ax = fig.add_subplot()
    several = sum(1 for r in runs for k, _, _ in keys if r.has(k)) > 1
    for i, run in enumerate(runs):
        for key, style, label in keys:
            xs, ys = run.series(key)
            if xs:
                shown = "peak RSS" if label == "peak" and on_cpu(run) else label
                ax.plot(xs, [y / scale for y in ys], color=colour(i), ls=style, lw=1.6,
                        label=f"{run.name} {shown}", marker="o" if len(xs) <= 30 and style == "-" else None, ms=3)
    _style(ax, memory_title(runs), unit)
    if several:
        ax.legend(fontsize=8, frameon=False)
    return _png(fig)


def tflops_plot(runs: list[Run]) -> str | None:
    return _line_plot(runs, "tflops", "Achieved model TFLOP/s (all ranks)", "TFLOP/s")


def loss_scale_plot(runs: list[Run]) -> str | None:
    return _line_plot(runs, "loss_scale", "fp16 loss scale", "loss scale", log=True)


def timing_plots(runs: list[Run]) -> tuple[str | None, str | None]:
    """(median seconds per part, stacked, one bar per run, with the rest of the step as
    "other" where the whole step's time is recorded; the step time per step), for runs that
    recorded any part; ``(None, None)`` when none did."""
    timed = [(i, r) for i, r in enumerate(runs) if r.timing_keys]
    if not timed:
        return None, None
    parts: list[str] = []
    for _, run in timed:
        parts += [k for k in run.timing_keys if k not in parts]
    medians: dict[str, list[float]] = {key: [] for key in [*parts, "other"]}
    for _, run in timed:
        for key in parts:
            values = run.series(key)[1]
            medians[key].append(statistics.median(values) if values else 0.0)
        others = []
        for rec in run.steps:
            total = rec.get(STEP_TIME)
            if isinstance(total, (int, float)):
                timed_parts = sum(float(rec[k]) for k in run.timing_keys if isinstance(rec.get(k), (int, float)))
                others.append(max(0.0, float(total) - timed_parts))
        medians["other"].append(statistics.median(others) if others else 0.0)
    if not any(medians["other"]):
        del medians["other"]
    fig = _figure(6.4, 1.4 + 0.5 * len(timed))
    ax = fig.add_subplot()
    names = [r.name for _, r in timed]
    left = [0.0] * len(timed)
    for j, (key, widths) in enumerate(medians.items()):
        colour_ = "#c9ccd1" if key == "other" else _PART_COLOURS[j % len(_PART_COLOURS)]
        label = "other (not timed)" if key == "other" else TIMING_KEYS.get(key, key.removesuffix("_s"))
        ax.barh(names, widths, left=left, color=colour_, label=label, height=0.6)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set_title("Step-time breakdown (median per step)", fontsize=11, loc="left")
    ax.set_xlabel("seconds")
    ax.grid(True, axis="x", alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)
    fig.legend(fontsize=8, frameon=False, loc="outside lower center", ncol=min(5, len(medians)))
    bars = _png(fig)

    fig = _figure()
    ax = fig.add_subplot()
    for i, run in timed:
        xs, ys = run.series(STEP_TIME)
        if not xs:  # no whole-step time: the sum of the recorded parts
            per_step: dict[int, float] = {}
            for key in run.timing_keys:
                for x, y in zip(*run.series(key), strict=True):
                    per_step[x] = per_step.get(x, 0.0) + y
            xs = sorted(per_step)
            ys = [per_step[x] for x in xs]
        ax.plot(xs, ys, color=colour(i), lw=1.6, label=run.name,
                marker="o" if len(xs) <= 30 else None, ms=3)
    _style(ax, "Step time", "seconds")
    if len(timed) > 1:
        ax.legend(fontsize=8, frameon=False)
    return bars, _png(fig)
