"""Metrics collection from a running trial: its stdout and its metrics JSONL file.

Stdout follows Katib's format: ``name=value`` pairs anywhere in a line, scientific
notation allowed, other text ignored; a ``step=N`` pair on the same line gives the step.
The JSONL file (``HYBRIDTRAIN_METRICS_FILE``) holds one JSON object per line, e.g.
``{"step": 3, "loss": 2.91}``; ``hybridtrain train`` and :func:`hybridtrain.hpo.report`
write it (its lines are read by :mod:`hybridtrain.server.metric_lines`, which the training
service's REST curve shares). A training run usually writes the same step to both, so
observations are keyed by ``(metric, step)`` and the second copy is dropped.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from hybridtrain.server.metric_lines import STEP_KEY, BadMetricLine, checked_step, parse_json_line

# A metric name starts with a letter or "_" and is not glued to a preceding word, dash or
# slash or URL query, so echoed flags ("--lr=0.1") and URLs are not taken for metrics.
# A value must not run on into a word or another ".digit" ("version=1.2.3" is no metric),
# but may end a sentence ("... loss=0.25.").
_PAIR = re.compile(
    r"(?<![\w.\-/?&])([A-Za-z_][\w.\-/]*)\s*=\s*"
    r"([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|[+-]?(?:nan|inf(?:inity)?))(?!\w|\.\d)",
    re.IGNORECASE,
)
log = logging.getLogger(__name__)


def parse_line(line: str) -> tuple[dict[str, float], int | None]:
    """Parse one stdout line in Katib's format.

    Args:
        line: any text.

    Returns:
        ``(metrics, step)``: every ``name=value`` pair except ``step``, and the integer
        ``step`` value if the line has one.
    """
    metrics: dict[str, float] = {}
    step: int | None = None
    for name, raw in _PAIR.findall(line):
        value = float(raw)
        if name == STEP_KEY:
            step = checked_step(value)
        else:
            metrics[name] = value
    return metrics, step


@dataclass(frozen=True)
class Observation:
    """One new value of a metric at a step."""

    metric: str
    value: float
    step: int


@dataclass
class _Tail:
    """Reads the lines appended to a file since the last call (the file may not exist yet)."""

    path: Path
    offset: int = 0
    partial: bytes = b""

    def read_lines(self, final: bool = False) -> list[str]:
        try:
            with self.path.open("rb") as f:
                if f.seek(0, 2) < self.offset:
                    # Rewritten shorter (a resumed training run truncates its metrics
                    # file): read it again; values already seen are dropped by step.
                    self.offset, self.partial = 0, b""
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        chunks = (self.partial + data).split(b"\n")
        # The last chunk is an unfinished line unless the writer has exited.
        self.partial = b"" if final else chunks.pop()
        return [c.decode("utf-8", "replace") for c in chunks if c.strip()]


@dataclass
class MetricsCollector:
    """Collects a trial's metrics from its stdout log and its metrics JSONL file.

    Args:
        stdout_path: the file the trial's stdout is written to.
        jsonl_path: the file named by ``HYBRIDTRAIN_METRICS_FILE`` for this trial.
    """

    stdout_path: Path
    jsonl_path: Path
    latest: dict[str, float] = field(default_factory=dict)
    bad_lines: int = 0
    """Lines skipped because they could not be recorded (the first one is logged)."""
    _series: dict[str, dict[int, float]] = field(default_factory=dict)
    _tails: list[tuple[_Tail, bool]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._tails = [(_Tail(self.jsonl_path), True), (_Tail(self.stdout_path), False)]

    def poll(self, final: bool = False) -> list[Observation]:
        """Read what the trial wrote since the last poll.

        Args:
            final: the trial has exited, so a last line without a newline is complete.

        Returns:
            The new observations, each ``(metric, step)`` at most once over the trial.
        """
        new: list[Observation] = []
        for tail, is_json in self._tails:
            parse = parse_json_line if is_json else parse_line
            for line in tail.read_lines(final):
                try:
                    metrics, step = parse(line)
                except BadMetricLine as exc:
                    self._bad(tail.path, line, exc)
                    continue
                for name, value in metrics.items():
                    obs = self._add(name, value, step)
                    if obs is not None:
                        new.append(obs)
        return new

    def _bad(self, path: Path, line: str, why: BadMetricLine) -> None:
        # One warning per trial: a trial printing a bad line every step must not flood the log.
        self.bad_lines += 1
        if self.bad_lines == 1:
            log.warning("%s: skipped a metrics line (%s): %.80r; later bad lines are only counted", path, why,
                        line)

    def _add(self, name: str, value: float, step: int | None) -> Observation | None:
        series = self._series.setdefault(name, {})
        if step is None:
            # A value without a step (e.g. a final summary line) comes after all others.
            step = max(series, default=-1) + 1
        elif step in series:
            return None
        series[step] = value
        self.latest[name] = series[max(series)]
        return Observation(name, value, step)

    def series(self, metric: str) -> dict[int, float]:
        """All values of ``metric`` by step."""
        return dict(self._series.get(metric, {}))

    def final_value(self, metric: str, strategy: str) -> float | None:
        """The trial's result for ``metric``.

        Args:
            metric: the objective metric.
            strategy: ``latest`` (value at the highest step), ``min`` or ``max``.

        Returns:
            The value, or ``None`` when the metric was never reported.
        """
        series = self._series.get(metric)
        if not series:
            return None
        if strategy == "min":
            return min(series.values())
        if strategy == "max":
            return max(series.values())
        return series[max(series)]
