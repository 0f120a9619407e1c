"""One line of a metrics JSONL file (``{"step": 3, "loss": 2.91}``) as numbers and a step.

``hybridtrain train`` and :func:`hybridtrain.hpo.report` write such files; the HPO
controller reads a trial's (:mod:`hybridtrain.hpo.metrics`) and the training service's
REST curve a job's (:mod:`hybridtrain.service.api`), both through :func:`parse_json_line`.
"""

from __future__ import annotations

import json
import math

STEP_KEY = "step"
MAX_STEP = 2**63 - 1
"""Steps are stored as 64-bit integers (Optuna's intermediate values): larger is a bad line."""


class BadMetricLine(ValueError):
    """A metrics line that names a metric but cannot be recorded (the reason says why)."""


def checked_step(raw: float) -> int | None:
    """``raw`` as a step; non-finite values give no step (as before), out-of-range ones
    (negative, past 64 bits) make the line bad."""
    if not math.isfinite(raw):
        return None
    if raw < 0 or raw > MAX_STEP:
        raise BadMetricLine(f"step {raw:g} is outside 0..2^63-1")
    return int(raw)


def parse_json_line(line: str) -> tuple[dict[str, float], int | None]:
    """Parse one JSONL metrics line; anything that is not a JSON object yields nothing.

    Returns:
        ``(metrics, step)``: every number but ``step``, and the integer ``step`` if the
        line has one.

    Raises:
        BadMetricLine: nested too deep to parse, a step out of range, or a number no
            float holds.
    """
    try:
        obj = json.loads(line)
    except RecursionError:
        raise BadMetricLine("JSON nested too deeply") from None
    except ValueError:
        return {}, None
    if not isinstance(obj, dict):
        return {}, None
    raw_step = obj.get(STEP_KEY)
    try:
        step = checked_step(float(raw_step)) if isinstance(raw_step, int | float) and not isinstance(raw_step, bool) \
            else None
        metrics = {
            k: float(v)
            for k, v in obj.items()
            if k != STEP_KEY and isinstance(v, int | float) and not isinstance(v, bool)
        }
    except OverflowError:
        raise BadMetricLine("a number too large for a float") from None
    return metrics, step
