"""One running trial: its process, its metrics, and what it reports to Optuna.

:class:`RunningTrial` is polled by the controller. Each poll reads the new metrics,
reports every objective value to Optuna as an intermediate value (so pruners see the
learning curve), asks the pruner, and checks the timeout and the exit code. When the
trial is over the poll returns an :class:`Outcome`; the controller records it.
"""

from __future__ import annotations

import math
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridtrain.hpo.attrs import set_user_attrs
from hybridtrain.hpo.metrics import MetricsCollector
from hybridtrain.hpo.process import TrialProcess
from hybridtrain.hpo.push import METRICS_FILE_ENV
from hybridtrain.hpo.spec import ExperimentSpec, render_command

if TYPE_CHECKING:
    import optuna


@dataclass(frozen=True)
class Outcome:
    """How a trial ended.

    Attributes:
        state: ``complete``, ``pruned``, ``failed`` or ``interrupted``.
        value: the objective value (complete and pruned trials).
        reason: one line for failed and interrupted trials.
    """

    state: str
    value: float | None = None
    reason: str = ""


def trial_dir(spec: ExperimentSpec, number: int) -> Path:
    """The directory of trial ``number``: logs, metrics file, and the trial's own files."""
    return Path(spec.output_dir).resolve() / spec.name / f"trial-{number:05d}"


def build_command(spec: ExperimentSpec, params: Mapping[str, Any], number: int,
                  directory: Path) -> str:
    """The trial's shell command with every placeholder replaced by its quoted value."""
    values = {name: shlex.quote(str(value)) for name, value in params.items()}
    values |= {"trial_number": str(number), "trial_dir": shlex.quote(str(directory)),
               "experiment": shlex.quote(spec.name)}
    return render_command(spec.trial.command, values)


class RunningTrial:
    """A started trial.

    Args:
        spec: the experiment spec.
        trial: the Optuna trial (parameters already suggested).
        slot: the slot it runs in.
        attempt: its attempt number within the slot.
        gpus: GPU indices given to it (``CUDA_VISIBLE_DEVICES``).
        attrs: user attributes to record with the trial's first poll (one transaction
            with its first metrics, instead of one of their own).

    Raises:
        OSError: the process could not be started.
    """

    def __init__(self, spec: ExperimentSpec, trial: optuna.Trial, slot: int, attempt: int,
                 gpus: tuple[int, ...] = (), attrs: Mapping[str, Any] | None = None) -> None:
        self.spec = spec
        self.pending_attrs = dict(attrs or {})
        self.trial = trial
        self.slot = slot
        self.attempt = attempt
        self.gpus = gpus
        self.params = dict(trial.params)
        self.dir = trial_dir(spec, trial.number)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.command = build_command(spec, self.params, trial.number, self.dir)
        env = dict(os.environ) | spec.trial.env | {
            METRICS_FILE_ENV: str(self.dir / "metrics.jsonl"),
            "HYBRIDTRAIN_HPO_EXPERIMENT": spec.name,
            "HYBRIDTRAIN_HPO_TRIAL": str(trial.number),
            # Python trials would otherwise buffer stdout and hide their metrics from
            # the pruner until they exit.
            "PYTHONUNBUFFERED": "1",
        }
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        self.process = TrialProcess(self.command, Path(spec.trial.workdir), env,
                                    self.dir / "stdout.log", self.dir / "stderr.log")
        self.collector = MetricsCollector(self.dir / "stdout.log", self.dir / "metrics.jsonl")
        self.process.start()

    @property
    def number(self) -> int:
        """The Optuna trial number."""
        return self.trial.number

    def poll(self) -> Outcome | None:
        """Collect new metrics and decide whether the trial is over.

        Returns:
            The outcome once the trial ended (or was pruned/timed out and stopped here),
            else ``None``.
        """
        code = self.process.poll()
        # A trial that already exited has spent its compute: it completes, never pruned.
        if self._collect(final=code is not None) and code is None:
            self.process.stop(self.spec.trial.kill_grace)
            return Outcome("pruned", self._value())
        if code is None:
            timeout = self.spec.trial.timeout
            if timeout is not None and self.process.elapsed() > timeout:
                self.process.stop(self.spec.trial.kill_grace)
                self._collect(final=True)
                return Outcome("failed", reason=f"timed out after {timeout:g} s")
            return None
        self.process.stop(self.spec.trial.kill_grace)  # whatever the command left behind
        return self._exit_outcome(code)

    def _collect(self, final: bool) -> bool:
        """Report new values to Optuna; returns whether the pruner says stop."""
        metric = self.spec.objective.metric
        new = self.collector.poll(final)
        # What Trial.report stores, written with the attributes in one transaction
        # (each public call would commit on its own).
        values = [(obs.step, obs.value) for obs in new
                  if obs.metric == metric and math.isfinite(obs.value)]
        if new:
            self.pending_attrs["metrics"] = dict(self.collector.latest)
        self.flush_attrs(values)
        if not values:
            return False
        # Trial.should_prune judges the values Trial.report cached in the Trial object;
        # these went to the storage directly, so the pruner reads them from there.
        study = self.trial.study
        return study.pruner.prune(study, self.trial.storage.get_trial(self.trial._trial_id))

    def flush_attrs(self, intermediate: list[tuple[int, float]] | None = None) -> None:
        """Write the pending user attributes (and ``intermediate`` values) in one commit."""
        if self.pending_attrs or intermediate:
            set_user_attrs(self.trial.storage, self.trial._trial_id, self.pending_attrs,
                           intermediate or ())
            self.pending_attrs = {}

    def _value(self) -> float | None:
        return self.collector.final_value(self.spec.objective.metric,
                                          self.spec.objective.strategy)

    def _exit_outcome(self, code: int) -> Outcome:
        metric = self.spec.objective.metric
        if code != 0:
            tail = self.process.stderr_tail()
            return Outcome("failed", reason=f"exit code {code}" + (f": {tail}" if tail else ""))
        value = self._value()
        if value is None:
            return Outcome("failed", reason=f"objective metric {metric!r} never reported")
        if not math.isfinite(value):
            return Outcome("failed", reason=f"objective metric {metric!r} is {value}")
        return Outcome("complete", value)

    def stop(self, reason: str) -> Outcome:
        """Stop the trial now (Ctrl-C, experiment stopped, lease lost)."""
        self.process.stop(self.spec.trial.kill_grace)
        self.collector.poll(final=True)
        return Outcome("interrupted", reason=reason)
