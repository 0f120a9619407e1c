"""Optuna samplers, pruners and distributions built from an :class:`ExperimentSpec`.

This is the one place that maps spec names (``tpe``, ``asha`` …) to Optuna classes, so
validation and the controller can never disagree about what a name means.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from typing import TYPE_CHECKING, Any

from hybridtrain.hpo.errors import SpecError
from hybridtrain.hpo.schema import CategoricalParam, ExperimentSpec, FloatParam, IntParam

if TYPE_CHECKING:
    import optuna

# name -> (Optuna class name, packages it needs beyond optuna)
_SAMPLERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "random": ("RandomSampler", ()),
    "grid": ("GridSampler", ()),
    "tpe": ("TPESampler", ()),
    "cmaes": ("CmaEsSampler", ("cmaes",)),
    "qmc": ("QMCSampler", ("scipy",)),
    "gp": ("GPSampler", ("scipy", "torch")),
}
_PRUNERS: dict[str, str] = {
    "none": "NopPruner",
    "median": "MedianPruner",
    "percentile": "PercentilePruner",
    "asha": "SuccessiveHalvingPruner",
    "hyperband": "HyperbandPruner",
}
# Options that are objects, not plain values, cannot come from a YAML file.
_CALLABLE_OPTIONS = {"gamma", "weights", "constraints_func", "independent_sampler",
                     "source_trials", "search_space"}
# Cap on grid size we are willing to enumerate during validation.
_MAX_GRID = 1_000_000


def distributions(spec: ExperimentSpec) -> dict[str, optuna.distributions.BaseDistribution]:
    """The Optuna distribution of every parameter of ``spec``, in spec order."""
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    out: dict[str, Any] = {}
    for name, p in spec.parameters.items():
        if isinstance(p, FloatParam):
            out[name] = FloatDistribution(p.low, p.high, log=p.log, step=p.step)
        elif isinstance(p, IntParam):
            out[name] = IntDistribution(p.low, p.high, log=p.log, step=p.step)
        else:
            out[name] = CategoricalDistribution(p.choices)
    return out


def _grid_count(name: str, p: FloatParam | IntParam | CategoricalParam) -> int:
    """How many grid values parameter ``name`` has (without enumerating them)."""
    if isinstance(p, CategoricalParam):
        return len(p.choices)
    if isinstance(p, IntParam):
        return (p.high - p.low) // p.step + 1
    if p.step is None:
        raise SpecError(
            f"invalid experiment spec: field 'parameters.{name}.step': algorithm grid "
            "needs a step for float parameters; got null"
        )
    return int((p.high - p.low) / p.step + 1e-9) + 1


def grid_size(spec: ExperimentSpec) -> int:
    """The number of grid points of ``spec``'s parameters.

    Raises:
        SpecError: a float parameter has no ``step``, or the grid has more than
            ``_MAX_GRID`` points (it is enumerated in memory).
    """
    size = 1
    for name, p in spec.parameters.items():
        size *= _grid_count(name, p)
        if size > _MAX_GRID:
            raise SpecError(
                f"invalid experiment spec: field 'parameters.{name}': the grid would have "
                f"more than {_MAX_GRID} points; got {size} so far; use larger steps or fewer "
                "values")
    return size


def grid_space(spec: ExperimentSpec) -> dict[str, list[Any]]:
    """Every value of every parameter, for the grid sampler.

    Raises:
        SpecError: see :func:`grid_size`.
    """
    grid_size(spec)  # refuse before enumerating a huge range
    space: dict[str, list[Any]] = {}
    for name, p in spec.parameters.items():
        count = _grid_count(name, p)
        if isinstance(p, CategoricalParam):
            space[name] = list(p.choices)
        elif isinstance(p, IntParam):
            space[name] = [p.low + i * p.step for i in range(count)]
        else:
            assert p.step is not None  # _grid_count refused it
            space[name] = [round(p.low + i * p.step, 12) for i in range(count)]
    return space


def _grid_sampler_class() -> Any:
    """Optuna's grid sampler without its ``study.stop()`` once the grid is exhausted.

    That call is only legal inside ``study.optimize``; from our ``study.tell`` it raises
    ``RuntimeError`` at the last grid point. The experiment's slots, not the sampler,
    decide when it ends, so the sampler has nothing to do after a trial.
    """
    import optuna

    class SlotGridSampler(optuna.samplers.GridSampler):
        def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
            return None

    return SlotGridSampler


def _construct(kind: str, name: str, cls_name: str, options: dict[str, Any],
               internal: dict[str, Any] | None = None) -> Any:
    import optuna

    module = optuna.samplers if kind == "algorithm" else optuna.pruners
    cls: Any = _grid_sampler_class() if cls_name == "GridSampler" else getattr(module,
                                                                              cls_name)
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self"} - _CALLABLE_OPTIONS
    for key in options:
        if key not in accepted:
            raise SpecError(
                f"invalid experiment spec: field '{kind}.{key}': unknown option for {name}; "
                f"allowed: {', '.join(sorted(accepted)) or 'none'}"
            )
    try:
        with warnings.catch_warnings():
            # The spec chose it: Optuna's "experimental" notice (QMC, GP) is only noise.
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return cls(**options, **(internal or {}))
    except (TypeError, ValueError) as exc:
        raise SpecError(
            f"invalid experiment spec: field '{kind}': {name} rejected options "
            f"{options}: {exc}"
        ) from None


def build_sampler(spec: ExperimentSpec, seed_offset: int = 0) -> optuna.samplers.BaseSampler:
    """The sampler named by ``spec.algorithm``, seeded and with its options.

    Args:
        spec: the experiment spec.
        seed_offset: added to ``algorithm.seed``; controllers of one experiment pass
            different offsets so they do not all propose the same random points.

    Raises:
        SpecError: a needed package is missing, or an option is unknown or rejected.
    """
    algo = spec.algorithm
    cls_name, packages = _SAMPLERS[algo.name]
    for package in packages:
        try:
            importlib.import_module(package)
        except ImportError:
            raise SpecError(
                f"invalid experiment spec: field 'algorithm.name': {algo.name!r} needs the "
                f"package {package!r}; install it (pip install {package}) or pick another"
            ) from None
    internal = {"search_space": grid_space(spec)} if algo.name == "grid" else None
    seed = None if algo.seed is None else algo.seed + seed_offset
    sampler: optuna.samplers.BaseSampler = _construct(
        "algorithm", algo.name, cls_name, algo.options | {"seed": seed}, internal)
    return sampler


def build_pruner(spec: ExperimentSpec) -> optuna.pruners.BasePruner:
    """The pruner named by ``spec.early_stopping`` with its options.

    Raises:
        SpecError: an option is unknown, missing (``percentile``) or rejected.
    """
    es = spec.early_stopping
    if es.name == "none" and es.options:
        raise SpecError(
            "invalid experiment spec: field 'early_stopping': name none takes no options; "
            f"got {sorted(es.options)}"
        )
    if es.name == "percentile" and "percentile" not in es.options:
        raise SpecError(
            "invalid experiment spec: field 'early_stopping.percentile': required for "
            "percentile (a number in [0, 100]); got nothing"
        )
    pruner: optuna.pruners.BasePruner = _construct("early_stopping", es.name,
                                                   _PRUNERS[es.name], es.options)
    return pruner


def _dry_run(spec: ExperimentSpec, sampler: optuna.samplers.BaseSampler,
             pruner: optuna.pruners.BasePruner) -> None:
    """Run two in-memory trials, so an option of the wrong type (``n_startup_trials:
    "3"``) fails here rather than in the middle of an experiment."""
    import optuna

    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # no "study created" chatter
    dists = distributions(spec)
    stage = "algorithm"
    try:
        study = optuna.create_study(sampler=sampler, pruner=pruner,
                                    direction=spec.objective.direction)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for value in (1.0, 2.0):
                stage = "algorithm"
                trial = study.ask(fixed_distributions=dists)
                stage = "early_stopping"
                trial.report(value, 1)
                trial.should_prune()
                stage = "algorithm"
                study.tell(trial, value)
    except (TypeError, ValueError, AttributeError) as exc:
        es = spec.early_stopping
        name, options = ((spec.algorithm.name, spec.algorithm.options) if stage == "algorithm"
                         else (es.name, es.options))
        raise SpecError(
            f"invalid experiment spec: field '{stage}': {name} failed a trial run with "
            f"options {options}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        ) from None
    finally:
        optuna.logging.set_verbosity(verbosity)


def check_algorithms(spec: ExperimentSpec) -> None:
    """Build the sampler and pruner and run them on two in-memory trials, so a bad option
    fails before any work starts.

    Raises:
        SpecError: see :func:`build_sampler`, :func:`build_pruner`; or ``max_trials``
            exceeds the grid size.
    """
    _dry_run(spec, build_sampler(spec), build_pruner(spec))
    if spec.algorithm.name == "grid":
        size = grid_size(spec)
        if spec.max_trials > size:
            raise SpecError(
                f"invalid experiment spec: field 'max_trials': exceeds the grid size {size}; "
                f"got {spec.max_trials}, set it to at most {size}"
            )
