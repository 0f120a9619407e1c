"""The Python API: create, run, inspect and stop experiments.

The CLI and the REST API are thin layers over :class:`ExperimentStore` and
:func:`run_experiment`, so all three report the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridtrain.hpo.errors import HPOError
from hybridtrain.hpo.records import ExperimentRecord, Records
from hybridtrain.hpo.spec import ExperimentSpec, load_spec
from hybridtrain.hpo.storage import open_optuna_storage, resolve_url
from hybridtrain.server.storage import open_engine

if TYPE_CHECKING:
    import optuna


def run_experiment(
    spec: ExperimentSpec | Mapping[str, Any] | str | Path,
    storage: str | None = None,
    on_event: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Build an experiment from a spec and run it to the end (resuming it if stored).

    Args:
        spec: an :class:`ExperimentSpec`, a spec dict, or a YAML/JSON file path.
        storage: storage URL (default: ``$HYBRIDTRAIN_HPO_STORAGE`` or ``sqlite:///hpo.db``).
        on_event: called with one line per trial event.

    Returns:
        The final :meth:`ExperimentStore.status`.

    Raises:
        SpecError: the spec is invalid or conflicts with the stored experiment.
        StorageError: the storage cannot be opened.
    """
    from hybridtrain.hpo.controller import Controller

    if not isinstance(spec, ExperimentSpec):
        spec = load_spec(spec)
    controller = Controller(spec, storage, on_event=on_event)
    controller.run()
    return ExperimentStore(controller.url).status(spec.name)


def _state(trial: optuna.trial.FrozenTrial) -> str:
    """``complete``, ``pruned``, ``fail``, ``running``, ``waiting``, or ``interrupted`` for
    an attempt stopped by Ctrl-C or ``hpo stop`` (a ``FAIL`` to Optuna)."""
    if trial.user_attrs.get("interrupted"):
        return "interrupted"
    return str(trial.state.name.lower())


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


class ExperimentStore:
    """Read and control the experiments of one storage.

    Args:
        storage: storage URL (default as in :func:`run_experiment`).

    Raises:
        StorageError: the storage cannot be opened.
    """

    def __init__(self, storage: str | None = None) -> None:
        self.url = resolve_url(storage)
        self.records = Records(open_engine(self.url))
        self._optuna: optuna.storages.RDBStorage | None = None

    @property
    def optuna_storage(self) -> optuna.storages.RDBStorage:
        """Optuna's storage on the same database (opened on first use)."""
        if self._optuna is None:
            self._optuna = open_optuna_storage(self.url)
        return self._optuna

    def create(self, spec: ExperimentSpec, exact: bool = False) -> ExperimentRecord:
        """Store a new experiment (or resume a stored one) without running it.

        Args:
            spec: the validated spec.
            exact: the stored experiment must have exactly this spec, every field (the REST
                API: a second caller re-posting a name with another command is a conflict,
                not a success whose command never runs).

        Raises:
            SpecError: it exists with a different search spec (with ``exact``: any difference).
        """
        import optuna

        from hybridtrain.hpo.algorithms import build_pruner, build_sampler

        record = self.records.ensure_experiment(spec, exact)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        optuna.create_study(storage=self.optuna_storage, study_name=spec.name,
                            sampler=build_sampler(spec), pruner=build_pruner(spec),
                            direction=spec.objective.direction, load_if_exists=True)
        return record

    def spec(self, name: str) -> ExperimentSpec:
        """The stored spec of experiment ``name``."""
        return ExperimentSpec.model_validate(self.records.get(name).spec)

    def study(self, name: str) -> optuna.Study:
        """The Optuna study of experiment ``name``.

        Raises:
            ExperimentNotFoundError: no such experiment.
        """
        import optuna

        self.records.get(name)
        return optuna.load_study(study_name=name, storage=self.optuna_storage)

    def list_experiments(self) -> list[dict[str, Any]]:
        """One summary per experiment: name, state, reason and trial counts."""
        return [self.status(r.name) for r in self.records.experiments()]

    def status(self, name: str) -> dict[str, Any]:
        """State and trial counts of experiment ``name``.

        Returns:
            ``{"name", "state", "reason", "max_trials", "failed_trials", "trials":
            {"complete", "pruned", "failed", "running", "waiting"}}``; ``failed`` counts
            failed attempts (retried ones included; attempts stopped by Ctrl-C or ``hpo
            stop`` are not failures and are left out), ``failed_trials`` the trials that
            failed for good; ``running``/``waiting`` are slots holding a lease or not yet
            started.

        Raises:
            ExperimentNotFoundError: no such experiment.
        """
        record = self.records.get(name)
        slots = self.records.slot_counts(name)
        states = [_state(t) for t in self.study(name).get_trials(deepcopy=False)]
        return {
            "name": name,
            "state": record.state,
            "reason": record.reason,
            "max_trials": sum(slots.values()),
            "failed_trials": record.failed_trials,
            "trials": {
                "complete": states.count("complete"),
                "pruned": states.count("pruned"),
                "failed": states.count("fail"),
                "running": slots["running"],
                "waiting": slots["pending"],
            },
        }

    def best(self, name: str) -> dict[str, Any]:
        """The best completed trial of experiment ``name``.

        Returns:
            ``{"value": float, "params": {...}, "trial": number}``.

        Raises:
            ExperimentNotFoundError: no such experiment.
            HPOError: no trial has completed yet.
        """
        study = self.study(name)
        try:
            best = study.best_trial
        except ValueError:
            raise HPOError(f"experiment {name!r} has no completed trial yet") from None
        return {"value": best.value, "params": best.params, "trial": best.number}

    def trials(self, name: str) -> list[dict[str, Any]]:
        """Every trial of experiment ``name`` with its parameters and metrics."""
        out = []
        objective = self.records.get(name).spec["objective"]["metric"]
        runs = {number: asdict(run) for number, run in self.records.trial_runs(name).items()}
        for t in self.study(name).get_trials(deepcopy=False):
            # Where it ran; experiments from before the table kept it in user attributes.
            run = runs.get(t.number) or t.user_attrs
            # The objective's latest value is its last intermediate value; the attribute
            # holds the other metrics (and, in older experiments, the objective too).
            steps = t.intermediate_values
            metrics = ({objective: steps[max(steps)]} if steps else {}) | t.user_attrs.get(
                "metrics", {})
            out.append({
                "number": t.number,
                "state": _state(t),
                "value": _finite(t.value),
                "params": t.params,
                "metrics": metrics,
                "intermediate": {str(k): _finite(v) for k, v in t.intermediate_values.items()},
                "slot": run.get("slot"),
                "attempt": run.get("attempt"),
                "fail_reason": t.user_attrs.get("fail_reason"),
                "trial_dir": run.get("trial_dir"),
                "started": t.datetime_start.isoformat() if t.datetime_start else None,
                "completed": t.datetime_complete.isoformat() if t.datetime_complete else None,
            })
        return out

    def stop(self, name: str) -> dict[str, Any]:
        """Ask every controller of ``name`` to stop its trials; resumable by ``hpo run``.

        Returns:
            The status after the request (``stopping``, or ``stopped`` when nothing ran).

        Raises:
            ExperimentNotFoundError: no such experiment.
        """
        self.records.get(name)
        self.records.set_state(name, "stopping", "stop requested", only_from=("running",))
        self.records.settle(name)
        return self.status(name)
