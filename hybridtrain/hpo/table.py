"""The live table ``hybridtrain hpo run`` shows while an experiment runs."""

from __future__ import annotations

import json
import sys
import threading
from typing import Any, TextIO

_COLUMNS = ("trial", "state", "value", "params")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "-" if value is None else str(value)


def render(status: dict[str, Any], trials: list[dict[str, Any]], limit: int = 15) -> str:
    """The experiment's status line and its most recent trials as a text table.

    Args:
        status: from :meth:`ExperimentStore.status`.
        trials: from :meth:`ExperimentStore.trials`.
        limit: how many of the latest trials to show.

    Returns:
        Lines joined by newlines (no trailing newline).
    """
    counts = " ".join(f"{k}={v}" for k, v in status["trials"].items())
    head = f"{status['name']}: {status['state']}  {counts}  (max_trials={status['max_trials']})"
    rows = [(str(t["number"]), t["state"], _fmt(t["value"]),
             json.dumps(t["params"], default=str)[:60]) for t in trials[-limit:]]
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(_COLUMNS)]
    lines = [head, "  ".join(c.ljust(w) for c, w in zip(_COLUMNS, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


class LiveTable(threading.Thread):
    """Redraws :func:`render` every ``interval`` seconds on a terminal.

    Args:
        store: an :class:`ExperimentStore` (its own database connections).
        name: the experiment.
        interval: seconds between redraws.
        out: the terminal stream.
    """

    def __init__(self, store: Any, name: str, interval: float = 1.0,
                 out: TextIO = sys.stdout) -> None:
        super().__init__(name="hpo-table", daemon=True)
        self.store, self.name, self.interval, self.out = store, name, interval, out
        self._stop_event = threading.Event()
        self._lines = 0

    def draw(self) -> None:
        """Replace the previously drawn table with the current one."""
        text = render(self.store.status(self.name), self.store.trials(self.name))
        # Move the cursor up over the old table and clear to the end of the screen.
        prefix = f"\x1b[{self._lines}F\x1b[J" if self._lines else ""
        self.out.write(prefix + text + "\n")
        self.out.flush()
        self._lines = text.count("\n") + 1

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            try:
                self.draw()
            except Exception:  # a busy database skips a frame; the next one catches up
                continue

    def stop(self) -> None:
        """Stop redrawing and draw the final table."""
        self._stop_event.set()
        if self.is_alive():
            self.join()
        self.draw()
