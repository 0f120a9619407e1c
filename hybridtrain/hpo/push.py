"""Push API for Python trials: ``hybridtrain.hpo.report(loss=0.3, step=10)``.

Inside a trial the controller sets ``HYBRIDTRAIN_METRICS_FILE`` to a file in the trial's
directory; :func:`report` appends one JSON line to it, the same format ``hybridtrain
train`` writes. Outside a trial it prints the Katib-format line instead, so a script works
unchanged under any collector that reads stdout. Standard library only: trial scripts
import it without pulling in Optuna.
"""

from __future__ import annotations

import json
import math
import os

METRICS_FILE_ENV = "HYBRIDTRAIN_METRICS_FILE"


def report(step: int | None = None, **metrics: float) -> None:
    """Report metric values of the current trial.

    Args:
        step: the training step the values belong to (``None``: after the last one).
        **metrics: ``name=value`` pairs, e.g. ``loss=0.31``.

    Raises:
        ValueError: no metric given, or a value is not a number.
    """
    if not metrics:
        raise ValueError("report() needs at least one metric, e.g. report(loss=0.3)")
    values: dict[str, float] = {}
    for name, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"metric {name!r} must be a number; got {value!r}")
        values[name] = float(value)
    path = os.environ.get(METRICS_FILE_ENV)
    if path:
        record: dict[str, object] = {} if step is None else {"step": int(step)}
        # JSON has no NaN/inf; strings keep the line valid and the collector skips them,
        # so a NaN objective reads as "never reported" rather than corrupting the file.
        record |= {k: v if math.isfinite(v) else str(v) for k, v in values.items()}
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    else:
        pairs = ([f"step={int(step)}"] if step is not None else []) + [
            f"{k}={v!r}" for k, v in values.items()
        ]
        print(" ".join(pairs), flush=True)
