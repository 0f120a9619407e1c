"""What watches a ``hybridtrain train`` run besides ``metrics.jsonl``: the Prometheus
endpoint (every rank) and the TensorBoard / CSV / W&B / MLflow monitors (rank 0).

The training loop builds each step's record once (:func:`hybridtrain.trainer`), appends it
to ``metrics.jsonl`` and hands the same dict here; every destination shows those numbers,
so they agree by construction. Nothing here touches the device.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hybridtrain.config import Config, ConfigError
from hybridtrain.monitoring.mlflow_monitor import open_mlflow, run_name, store_problem
from hybridtrain.monitoring.monitors import (
    CSVMonitor,
    Monitor,
    MonitorSet,
    Outcome,
    TensorBoardMonitor,
    WandbMonitor,
    events_of,
    missing_packages,
)
from hybridtrain.monitoring.prometheus import MetricsServer


def check_monitoring(cfg: Config) -> None:
    """Refuse, in one line and before anything is built, destinations that cannot work.

    Raises:
        ConfigError: an enabled destination's package is missing, or its tracking store
            cannot be used.
    """
    problems = missing_packages(cfg.tensorboard.enabled, cfg.wandb.enabled, cfg.train.metrics_port > 0,
                                cfg.mlflow.enabled)
    # Only the writing rank (0) opens the MLflow run, so only it asks the store (several ranks
    # creating one sqlite database at once would race).
    if cfg.mlflow.enabled and not problems and global_rank() == 0:
        why = store_problem(cfg.mlflow.tracking_uri)
        if why is not None:
            problems.append(f"mlflow.tracking_uri = {cfg.mlflow.tracking_uri!r}: {why}")
    if problems:
        raise ConfigError("; ".join(problems))


def local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK`` as torchrun sets it; 0 alone)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def global_rank() -> int:
    """This process's global rank (``RANK``; 0 alone)."""
    return int(os.environ.get("RANK", "0"))


class Telemetry:
    """The run's metrics endpoint and monitors. Open with :meth:`start_server` (early, so
    ``/metrics`` answers while the model is still being built) and :meth:`open_monitors`
    (rank 0, once the output directory is known); :meth:`close` always.
    """

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.server: MetricsServer | None = None
        self.monitors = MonitorSet([])
        self.samples_per_step = 0

    def start_server(self) -> None:
        """Serve ``/metrics`` on ``metrics_port + LOCAL_RANK`` when ``metrics_port`` is set.

        Raises:
            ConfigError: the address cannot be bound.
        """
        port = self.cfg.train.metrics_port
        if not port:
            return
        host, port = self.cfg.train.metrics_host, port + local_rank()
        try:
            self.server = MetricsServer(host, port, global_rank())
        except OSError as exc:
            raise ConfigError(f"train.metrics_port: cannot serve metrics on {host}:{port} "
                              f"({exc.strerror or exc}); choose another port or metrics_host") from None
        print(f"metrics: serving {self.server.url}", file=sys.stderr, flush=True)

    def open_monitors(self, writer: bool, samples_per_step: int, start_step: int,
                      run_config: Mapping[str, Any] | None = None) -> None:
        """Open the enabled monitors on the writing rank.

        Raises:
            ConfigError: a monitor directory cannot be created.
        """
        self.samples_per_step = samples_per_step
        if not writer:
            return
        cfg, monitors = self.cfg, list[Monitor]()
        resumed = (start_step, start_step * samples_per_step) if start_step else None
        try:
            if cfg.tensorboard.enabled:
                monitors.append(TensorBoardMonitor(self._job_dir("tensorboard", cfg.tensorboard.output_path,
                                                                 cfg.tensorboard.job_name)))
            if cfg.csv_monitor.enabled:
                monitors.append(CSVMonitor(self._job_dir("csv_monitor", cfg.csv_monitor.output_path,
                                                         cfg.csv_monitor.job_name), resumed))
            if cfg.wandb.enabled:
                monitors.append(WandbMonitor(cfg.wandb.project, cfg.wandb.group, cfg.wandb.team,
                                             Path(cfg.train.output_dir), run_config,
                                             run_name("", cfg.train.output_dir, os.environ), resume=start_step > 0))
            if cfg.mlflow.enabled:
                monitors.append(open_mlflow(cfg.mlflow, cfg.train.output_dir, run_config or cfg.model_dump(),
                                            resume=start_step > 0))
        except BaseException:
            for monitor in monitors:
                monitor.close()
            raise
        self.monitors = MonitorSet(monitors)

    def _job_dir(self, section: str, output_path: str, job_name: str) -> Path:
        path = Path(output_path or self.cfg.train.output_dir) / job_name
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"{section}.output_path: cannot create {str(path)!r} "
                              f"({exc.strerror or exc})") from None
        return path

    def started(self, step: int, restarts: int) -> None:
        """Show where the run starts (before its first step)."""
        if self.server is not None:
            self.server.update({"step": step, "restarts": restarts})

    def publish(self, record: Mapping[str, Any]) -> None:
        """Show one metrics.jsonl record: a step's, an evaluation's or a checkpoint's."""
        if self.server is not None:
            self.server.update(record)
        if self.monitors:
            samples = int(record["step"]) * self.samples_per_step if "loss" in record else None
            self.monitors.write(events_of(record, samples))

    def close(self, linger_s: float = 0.0, outcome: Outcome = "finished") -> None:
        """Flush and close the monitors (telling them the run's ``outcome``); keep serving
        ``linger_s`` seconds, then stop."""
        self.monitors.close(outcome)
        if self.server is None:
            return
        if linger_s > 0:
            print(f"metrics: still serving {self.server.url} for {linger_s:g} s", file=sys.stderr, flush=True)
            _wait_unless_stopped(linger_s)
        self.server.close()
        self.server = None


def _wait_unless_stopped(seconds: float) -> None:
    """Sleep ``seconds``; SIGTERM or Ctrl-C end the wait early (not the process)."""
    done = threading.Event()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        done.wait(seconds)
    except KeyboardInterrupt:
        pass
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
