"""DeepSpeed's monitor sections — ``tensorboard``, ``csv_monitor``, ``wandb`` — for
``hybridtrain train`` (MLflow, the ``mlflow`` section, is in :mod:`.mlflow_monitor`).

Each step is written twice: under our names (``hybridtrain/<metrics.jsonl field>``, indexed
by optimizer step) and under DeepSpeed's (``Train/Samples/train_loss``, ``Train/Samples/lr``
and, with fp16, ``Train/Samples/loss_scale``, indexed by samples seen), so dashboards made
for either keep working. Only rank 0 writes. The writes happen on a background thread, so
the training loop only hands over a dict per step.

- TensorBoard: event files in ``output_path/job_name`` through
  ``torch.utils.tensorboard.SummaryWriter``.
- CSV: one file per metric in ``output_path/job_name``, as DeepSpeed's csv monitor writes
  them: the name with ``/`` and spaces turned into ``_`` plus ``.csv``, a header row
  ``step,<last part of the name>``, then ``index,value`` rows.
- W&B: ``wandb.init(project, group, entity=team, name)`` (``name``: the training service's job
  name, else the output directory's) and one ``wandb.log`` per step (the
  ``Train/Samples/*`` series use ``samples`` as their x-axis). Without ``WANDB_MODE`` set,
  a run whose W&B server cannot be reached within a second logs offline (``wandb sync``
  uploads it later).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import logging
import os
import queue
import socket
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Literal, Protocol
from urllib.parse import urlparse

log = logging.getLogger("hybridtrain.monitoring")

OURS = "hybridtrain/"
DEEPSPEED = {"loss": "Train/Samples/train_loss", "lr": "Train/Samples/lr", "loss_scale": "Train/Samples/loss_scale"}
"""Our record field → DeepSpeed's monitor name (indexed by samples seen)."""

Event = tuple[str, float, int]
"""(name, value, index) — DeepSpeed's ``write_events`` element."""


def events_of(record: Mapping[str, Any], samples: int | None = None) -> list[Event]:
    """The monitor events of one metrics.jsonl record: every numeric field under our name
    at its step, and (``samples`` given) DeepSpeed's names at ``samples``."""
    step = int(record["step"])
    events = [(OURS + k, float(v), step) for k, v in record.items()
              if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)]
    if samples is not None:
        events += [(DEEPSPEED[k], float(record[k]), samples) for k in DEEPSPEED if k in record]
    return events


Outcome = Literal["finished", "interrupted", "failed"]
"""How a run ended: all its steps, stopped early (SIGTERM, preemption: it resumes later), or an error."""


class Monitor(Protocol):
    """DeepSpeed's monitor interface (plus flush and close). A monitor that records how the run
    ended (an experiment tracker's run status) also has an ``outcome`` attribute, which
    :meth:`MonitorSet.close` sets before it closes the monitor."""

    def write_events(self, events: list[Event]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class TensorBoardMonitor:
    """Scalars into TensorBoard event files under ``log_dir``.

    The scalars sharing an index go into one summary (one event per step and axis instead
    of one per scalar): what TensorBoard reads is the same, writing costs a tenth.
    """

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=str(log_dir), max_queue=100)

    def write_events(self, events: list[Event]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard.summary import scalar

        by_index: dict[int, list[Any]] = {}
        for name, value, index in events:
            by_index.setdefault(index, []).extend(scalar(name, value).value)
        file_writer = self.writer._get_file_writer()
        for index, values in by_index.items():
            file_writer.add_summary(Summary(value=values), index)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class CSVMonitor:
    """DeepSpeed's csv monitor: one ``<name>.csv`` per metric under ``log_dir``.

    Args:
        keep_until: on resume, ``(step, samples)``: rows past these indices (steps that will
            be trained again) are dropped from existing files, as metrics.jsonl does.
    """

    def __init__(self, log_dir: Path, keep_until: tuple[int, int] | None = None) -> None:
        self.log_dir = log_dir
        self._files: dict[str, tuple[IO[str], Any]] = {}
        if keep_until is not None:
            for path in log_dir.glob("*.csv"):
                limit = keep_until[1] if path.name.startswith("Train_") else keep_until[0]
                _truncate_csv(path, limit)

    @staticmethod
    def filename(name: str) -> str:
        """DeepSpeed's file name of a metric: ``/`` and spaces → ``_``, plus ``.csv``."""
        return name.replace("/", "_").replace(" ", "_") + ".csv"

    def write_events(self, events: list[Event]) -> None:
        for name, value, index in events:
            entry = self._files.get(name)
            if entry is None:
                path = self.log_dir / self.filename(name)
                fresh = not path.exists() or path.stat().st_size == 0
                fh = open(path, "a", newline="", encoding="utf-8")  # noqa: SIM115 - kept open
                entry = self._files[name] = (fh, csv.writer(fh))
                if fresh:
                    entry[1].writerow(["step", name.split("/")[-1]])
            entry[1].writerow([index, value])

    def flush(self) -> None:
        for fh, _ in self._files.values():
            fh.flush()

    def close(self) -> None:
        for fh, _ in self._files.values():
            fh.close()
        self._files.clear()


def _truncate_csv(path: Path, limit: int) -> None:
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = lines[:1] + [line for line in lines[1:] if _index(line) <= limit]
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def _index(line: str) -> float:
    try:
        return float(line.split(",", 1)[0])
    except ValueError:
        return float("inf")


#: Where a W&B run's id is kept, in ``train.output_dir``, for a resumed run to continue it.
WANDB_RUN_FILE = "wandb_run.json"


class WandbMonitor:
    """Logs each step to Weights & Biases (rank 0). A resumed run (``resume``) continues the W&B
    run whose id is in ``run_dir/wandb_run.json`` (W&B drops steps it has seen: a restart's
    retrained steps keep their first values)."""

    def __init__(self, project: str, group: str | None, team: str | None, run_dir: Path,
                 config: Mapping[str, Any] | None = None, name: str | None = None, resume: bool = False) -> None:
        import wandb

        self.mode = choose_wandb_mode()
        self.wandb = wandb
        run_dir.mkdir(parents=True, exist_ok=True)
        recorded = _recorded_wandb_id(run_dir) if resume else None
        self.run = wandb.init(project=project, group=group, entity=team, dir=str(run_dir),
                              config=dict(config or {}), name=name,
                              id=recorded, resume="allow" if recorded else None)  # None: wandb's defaults
        if getattr(self.run, "id", None):
            (run_dir / WANDB_RUN_FILE).write_text(json.dumps({"id": self.run.id}))
        self.outcome: Outcome = "finished"
        if hasattr(wandb, "define_metric"):
            wandb.define_metric("samples")
            wandb.define_metric("Train/Samples/*", step_metric="samples")

    def write_events(self, events: list[Event]) -> None:
        if not events:
            return
        # One log call per record: our names at the step, DeepSpeed's with their samples.
        step = max(index for name, _, index in events if name.startswith(OURS)) if any(
            name.startswith(OURS) for name, _, _ in events) else None
        data: dict[str, float] = {name: value for name, value, _ in events}
        samples = [index for name, _, index in events if not name.startswith(OURS)]
        if samples:
            data["samples"] = float(samples[0])
        self.wandb.log(data, step=step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        # W&B marks a run with a nonzero exit code failed (an interrupted one is continued when it resumes).
        self.run.finish(exit_code=0 if self.outcome == "finished" else 1)


def _recorded_wandb_id(run_dir: Path) -> str | None:
    """The W&B run id kept in ``run_dir``; ``None`` without a readable one."""
    try:
        recorded = json.loads((run_dir / WANDB_RUN_FILE).read_text())["id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return recorded if isinstance(recorded, str) and recorded else None


def choose_wandb_mode(timeout: float = 1.0) -> str:
    """``WANDB_MODE`` as the user set it; otherwise ``offline`` (set in the environment)
    when the W&B server (``WANDB_BASE_URL``, default api.wandb.ai) does not answer a TCP
    connection within ``timeout`` seconds, else ``online``."""
    mode = os.environ.get("WANDB_MODE")
    if mode:
        return mode
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "api.wandb.ai", port), timeout=timeout):
            return "online"
    except OSError:
        os.environ["WANDB_MODE"] = "offline"
        log.info("W&B server %s unreachable: logging offline (upload later with `wandb sync`)", url.geturl())
        return "offline"


def missing_packages(tensorboard: bool, wandb: bool, prometheus: bool, mlflow: bool = False) -> list[str]:
    """One-line problems for enabled destinations whose package is not installed."""
    problems = []
    if prometheus and not _installed("prometheus_client"):
        problems.append("train.metrics_port is set but prometheus_client is not installed "
                        "(pip install 'hybridtrain[monitor]')")
    if tensorboard and not _installed("tensorboard"):
        problems.append("tensorboard.enabled is true but the tensorboard package is not installed "
                        "(pip install 'hybridtrain[monitor]', or set tensorboard.enabled: false)")
    if wandb and not _installed("wandb"):
        problems.append("wandb.enabled is true but the wandb package is not installed "
                        "(pip install wandb, or set wandb.enabled: false)")
    if mlflow and not _installed("mlflow"):
        problems.append("mlflow.enabled is true but the mlflow package is not installed "
                        "(pip install 'hybridtrain[tracking]', or set mlflow.enabled: false)")
    return problems


def _installed(name: str) -> bool:
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


class MonitorSet:
    """The enabled monitors, fed from a background thread.

    :meth:`write` queues events and returns; the thread writes them and flushes whenever the
    queue runs empty. A failing monitor is reported once and dropped; training goes on.
    """

    def __init__(self, monitors: list[Monitor]) -> None:
        self.monitors = monitors
        self._queue: queue.SimpleQueue[list[Event] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if monitors:
            self._thread = threading.Thread(target=self._run, name="hybridtrain-monitors", daemon=True)
            self._thread.start()

    def __bool__(self) -> bool:
        return bool(self.monitors)

    def write(self, events: list[Event]) -> None:
        """Queue ``events`` for every monitor."""
        if self._thread is not None:
            self._queue.put(events)

    def close(self, outcome: Outcome = "finished") -> None:
        """Write what is queued, tell the monitors that record it the run's ``outcome``, flush and
        close every monitor (idempotent)."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join()
        self._thread = None
        for monitor in list(self.monitors):
            if hasattr(monitor, "outcome"):
                monitor.outcome = outcome
            self._guard(monitor, "close")

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            for monitor in list(self.monitors):
                self._guard(monitor, "write_events", item)
            if self._queue.empty():
                for monitor in list(self.monitors):
                    self._guard(monitor, "flush")
        for monitor in list(self.monitors):
            self._guard(monitor, "flush")

    def _guard(self, monitor: Monitor, method: str, *args: Any) -> None:
        try:
            getattr(monitor, method)(*args)
        except Exception as exc:  # noqa: BLE001 - a dashboard must not stop training
            log.warning("%s.%s failed (%s: %s); it is switched off for this run",
                        type(monitor).__name__, method, type(exc).__name__, exc)
            if monitor in self.monitors:
                self.monitors.remove(monitor)
