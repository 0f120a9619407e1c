"""MLflow tracking of a ``hybridtrain train`` run (the config's ``mlflow`` section), behind the
:class:`~hybridtrain.monitoring.monitors.Monitor` protocol.

One MLflow run per training run: created with the config flattened into parameters and whole as
the artifact ``config.json``; each metrics.jsonl field then becomes a metric at its step (our
names without the ``hybridtrain/`` prefix; DeepSpeed's samples-indexed copies are left out, MLflow
has one step axis). The run's id is kept in ``train.output_dir/mlflow_run.json`` so that a resumed
run (a restart, a preempted service job) logs into the same MLflow run. Metrics are sent in
batches when the monitor thread flushes, so a slow tracking server never holds a training step.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hybridtrain.config import ConfigError
from hybridtrain.monitoring.monitors import OURS, Event, Outcome

#: Where the run's id is kept, in ``train.output_dir``.
RUN_FILE = "mlflow_run.json"
#: MLflow's limits per ``log_batch`` call (params, metrics) and on a param value's length
#: (500 on servers before MLflow 2.8; the whole config is in ``config.json`` anyway).
PARAMS_PER_BATCH, METRICS_PER_BATCH, PARAM_VALUE_CHARS = 100, 1000, 500
#: Tag naming the training service's job.
JOB_TAG = "hybridtrain.job"
#: MLflow's run status for each way a run ends (an interrupted run is resumed into the same run).
RUN_STATUS: dict[Outcome, str] = {"finished": "FINISHED", "interrupted": "KILLED", "failed": "FAILED"}


def flat_params(config: Mapping[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """The config as MLflow parameters: nested sections joined by ``.``, every leaf as its JSON
    text (cut to :data:`PARAM_VALUE_CHARS`), empty sections left out."""
    out: list[tuple[str, str]] = []
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out += flat_params(value, name + ".")
        elif not (isinstance(value, Mapping) and not value):
            out.append((name, json.dumps(value)[:PARAM_VALUE_CHARS]))
    return out


def run_name(configured: str, output_dir: str, env: Mapping[str, str]) -> str:
    """The configured name, else the service's job name, else ``output_dir``'s last part."""
    return configured or env.get("HYBRIDTRAIN_JOB_NAME", "") or Path(output_dir).name or "hybridtrain"


def run_tags(configured: Mapping[str, str], env: Mapping[str, str]) -> dict[str, str]:
    """The configured tags plus the service's job name under :data:`JOB_TAG`."""
    job = env.get("HYBRIDTRAIN_JOB_NAME")
    return dict(configured) | ({JOB_TAG: job} if job else {})


def metric_points(events: list[Event]) -> list[tuple[str, float, int]]:
    """``(metric name, value, step)`` of our step-indexed events (DeepSpeed's copies dropped)."""
    return [(name[len(OURS):], value, index) for name, value, index in events if name.startswith(OURS)]


def store_problem(tracking_uri: str, timeout: float = 5.0) -> str | None:
    """Why runs cannot be logged at ``tracking_uri`` (one line), or ``None``: an ``http(s)``
    server must answer ``/health`` within ``timeout`` (asked first: MLflow's client would retry
    for minutes), then the store must answer a query (MLflow 3 refuses a directory store unless
    ``MLFLOW_ALLOW_FILE_STORE=true``; a database is created here when missing)."""
    if tracking_uri.lower().startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(tracking_uri.rstrip("/") + "/health", timeout=timeout):  # noqa: S310
                pass
        except OSError as exc:
            return f"it does not answer ({getattr(exc, 'reason', None) or exc}); start the tracking server, " \
                   "or fix the address"
    try:
        from mlflow.tracking import MlflowClient

        MlflowClient(tracking_uri or None).search_experiments(max_results=1)
    except Exception as exc:  # noqa: BLE001 - whatever the store says, said in one line
        return f"MLflow cannot use it ({type(exc).__name__}: {first_line(exc)})"
    return None


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (MLflow's run to paragraphs)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class MLflowMonitor:
    """Logs one run to MLflow (module docstring).

    Args:
        tracking_uri: the config's ``mlflow.tracking_uri`` (empty: MLflow's default).
        experiment: experiment name (created when missing).
        name: run name; tags: run tags.
        config: the run's whole config (parameters and ``config.json``).
        run_dir: ``train.output_dir`` (holds :data:`RUN_FILE`).
        resume: continue the run recorded in ``run_dir`` (when it is on this tracking server).
    """

    def __init__(self, tracking_uri: str, experiment: str, name: str, tags: Mapping[str, str],
                 config: Mapping[str, Any], run_dir: Path, resume: bool) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri or None)
        self.pending: list[tuple[str, float, int]] = []
        self.outcome: Outcome = "finished"
        recorded = self._recorded_run(run_dir) if resume else None
        if recorded is not None:
            self.run_id = recorded
            self.client.update_run(self.run_id, status="RUNNING")
            return
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=name, tags=dict(tags)).info.run_id
        self._log_config(config)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / RUN_FILE).write_text(json.dumps({"tracking_uri": self.client.tracking_uri,
                                                    "run_id": self.run_id}))

    def _recorded_run(self, run_dir: Path) -> str | None:
        """The run id in ``run_dir`` when it names a run of this tracking server."""
        try:
            recorded = json.loads((run_dir / RUN_FILE).read_text())
            if recorded["tracking_uri"] != self.client.tracking_uri:
                return None
            return str(self.client.get_run(recorded["run_id"]).info.run_id)
        except Exception:  # noqa: BLE001 - no file, a bad one, or a run deleted since: start a new run
            return None

    def _log_config(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(key, value) for key, value in flat_params(config)]
        for start in range(0, len(params), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[start:start + PARAMS_PER_BATCH])
        self.client.log_dict(self.run_id, dict(config), "config.json")

    def write_events(self, events: list[Event]) -> None:
        self.pending += metric_points(events)

    def flush(self) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        while self.pending:
            batch = self.pending[:METRICS_PER_BATCH]
            self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v, step in batch])
            del self.pending[:len(batch)]

    def close(self) -> None:
        self.flush()
        self.client.set_terminated(self.run_id, RUN_STATUS[self.outcome])


def open_mlflow(section: Any, output_dir: str, config: Mapping[str, Any], resume: bool) -> MLflowMonitor:
    """The monitor of the config's ``mlflow`` section for a run writing to ``output_dir``.

    Raises:
        ConfigError: the run cannot be opened (one line, naming ``mlflow.tracking_uri``).
    """
    try:
        return MLflowMonitor(section.tracking_uri, section.experiment,
                             run_name(section.run_name, output_dir, os.environ), run_tags(section.tags, os.environ),
                             config, Path(output_dir), resume)
    except Exception as exc:  # noqa: BLE001 - the store's failure, said in one line
        raise ConfigError(f"mlflow.tracking_uri = {section.tracking_uri!r}: cannot open the MLflow run "
                          f"({type(exc).__name__}: {first_line(exc)})") from None
