"""One running trial: its process, its metrics, and what it reports to Optuna.

:class:`RunningTrial` is polled by the controller. Each poll reads the new metrics,
reports every objective value to Optuna as an intermediate value (so pruners see the
learning curve), stores the other metrics' latest values in the trial's ``metrics``
user attribute, asks the pruner, and checks the timeout and the exit code. When the
trial is over the poll returns an :class:`Outcome`; the controller records it.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optuna.exceptions import UpdateFinishedTrialError
from optuna.pruners import NopPruner

from hybridtrain.hpo.metrics import MetricsCollector
from hybridtrain.hpo.process import TrialProcess
from hybridtrain.hpo.push import METRICS_FILE_ENV
from hybridtrain.hpo.shell import argv_without_shell
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


def _placeholder_values(spec: ExperimentSpec, params: Mapping[str, Any], number: int,
                        directory: Path) -> dict[str, str]:
    values = {name: str(value) for name, value in params.items()}
    return values | {"trial_number": str(number), "trial_dir": str(directory),
                     "experiment": spec.name}


def build_command(spec: ExperimentSpec, params: Mapping[str, Any], number: int,
                  directory: Path) -> str:
    """The trial's shell command with every placeholder replaced by its quoted value."""
    values = _placeholder_values(spec, params, number, directory)
    return render_command(spec.trial.command, {k: shlex.quote(v) for k, v in values.items()})


class RunningTrial:
    """A trial's process with its metrics: prepared, then started with :meth:`start`.

    Args:
        spec: the experiment spec.
        trial: the Optuna trial (parameters already suggested).
        slot: the slot it runs in.
        attempt: its attempt number within the slot.
        gpus: GPU indices given to it (``CUDA_VISIBLE_DEVICES``).
        runner: makes the trial's process from :class:`TrialProcess`'s arguments (the
            controller passes one that runs the trial as a training-service job).
    """

    def __init__(self, spec: ExperimentSpec, trial: optuna.Trial, slot: int, attempt: int,
                 gpus: tuple[int, ...] = (),
                 runner: Callable[..., TrialProcess] = TrialProcess) -> None:
        self.spec = spec
        self.trial = trial
        # Without a pruner, asking it would cost a storage read per poll for nothing.
        self._prunes = not isinstance(trial.study.pruner, NopPruner)
        self.slot = slot
        self.attempt = attempt
        self.gpus = gpus
        self.params = dict(trial.params)
        self.dir = trial_dir(spec, trial.number)
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
        argv = argv_without_shell(
            spec.trial.command, _placeholder_values(spec, self.params, trial.number, self.dir),
            env.get("PATH"), spec.trial.workdir)
        self.process = runner(self.command, Path(spec.trial.workdir), env,
                                    self.dir / "stdout.log", self.dir / "stderr.log", argv)
        self.collector = MetricsCollector(self.dir / "stdout.log", self.dir / "metrics.jsonl")

    def start(self) -> None:
        """Create the trial's directory and start its process.

        A directory already there was left under the same trial number by an earlier
        run whose database is gone (deleted, or rolled back by a power loss): it is
        renamed ``trial-NNNNN.old-K``, kept, and never read as this trial's output.

        Raises:
            OSError: either failed.
        """
        try:
            self.dir.mkdir(parents=True)
        except FileExistsError:
            k = 1
            while (old := self.dir.with_name(f"{self.dir.name}.old-{k}")).exists():
                k += 1
            self.dir.rename(old)
            self.dir.mkdir()
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
            self.process.stop(self.spec.trial.kill_grace, pruned=True)
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
        bad = self.collector.bad_lines
        new = self.collector.poll(final)
        if self.collector.bad_lines != bad:  # recorded as bad, skipped (metrics.MetricsCollector)
            self._record_bad_lines()
        if not new:
            return False
        metric = self.spec.objective.metric
        values = [obs for obs in new if obs.metric == metric and math.isfinite(obs.value)]
        try:
            # Optuna's public calls, one commit each: a poll rarely has more than a few
            # new values, and per value the ORM work, not the commit, is the cost.
            for obs in values:
                self.trial.report(obs.value, obs.step)
            # The other metrics' latest values; the objective's are the reports above.
            if any(obs.metric != metric for obs in new):
                self.trial.set_user_attr("metrics", {
                    k: v for k, v in self.collector.latest.items() if k != metric})
        except UpdateFinishedTrialError:
            return False  # recorded by the controller that took our slot over; it settles
        return bool(values) and self._prunes and self.trial.should_prune()

    def _record_bad_lines(self) -> None:
        with contextlib.suppress(UpdateFinishedTrialError):
            self.trial.set_user_attr("bad_metric_lines", self.collector.bad_lines)

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
