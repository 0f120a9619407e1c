"""The experiment spec's fields: typed, validated models of one HPO experiment.

A spec is YAML or JSON (or a dict from Python)::

    name: lr-search
    objective: {metric: loss, direction: minimize, goal: 0.5, strategy: latest}
    parameters:
      lr: {type: float, low: 1.0e-5, high: 1.0e-1, log: true}
      layers: {type: int, low: 2, high: 8, step: 2}
      act: {type: categorical, choices: [gelu, relu]}
    algorithm: {name: tpe, seed: 0}
    early_stopping: {name: median}
    trial:
      command: "hybridtrain train cfg.yaml --set optimizer.params.lr=${lr}"
    max_trials: 20

:func:`validate_spec` turns any malformed field into a one-line :class:`SpecError` that
names the field, the value and what is allowed. It checks the fields only: whether the
algorithm and early-stopping options suit their Optuna classes is
:func:`hybridtrain.hpo.algorithms.check_algorithms`' job, which needs these models, so this
module imports neither it nor :mod:`hybridtrain.hpo.spec` (layering: schema ← algorithms ←
spec). Load specs with :func:`hybridtrain.hpo.spec.load_spec`, which does both checks.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hybridtrain.hpo.errors import SpecError
from hybridtrain.hpo.shell import quoted_placeholders

#: Placeholders every command may use besides the parameter names.
BUILTIN_PLACEHOLDERS = ("trial_number", "trial_dir", "experiment")
_PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")
_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Upper limits of the numbers in a spec. Specs arrive over the REST API, so every count
# that becomes rows, processes or threads is bounded; the limits are far above any real
# experiment on one database (an experiment's rows are created up front, one per trial).
MAX_TRIALS = 100_000
MAX_PARALLEL = 1_024
MAX_RETRIES = 100
MAX_PARAMETERS = 256
MAX_CHOICES = 10_000
MAX_SECONDS = 30 * 24 * 3600  # a trial timeout of at most 30 days
MAX_COMMAND = 64 * 1024
MAX_GPU_INDEX = 1_023


class _FieldError(ValueError):
    """A cross-field check's error, with the field it is about (the model's own location
    would be the whole spec)."""

    def __init__(self, field: str, message: str, value: Any) -> None:
        super().__init__(message)
        self.field, self.value = field, value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ObjectiveSpec(_Strict):
    """What to optimize.

    Attributes:
        metric: name of the metric printed by the trial (``loss`` in ``loss=0.3``).
        direction: ``minimize`` or ``maximize``.
        goal: stop starting new trials once a finished trial reaches this value.
        strategy: which reported value is the trial's result: the ``latest``, the ``min``
            or the ``max`` of all values the trial reported.
        additional_metrics: other metric names to record with each trial.
    """

    metric: str = Field(pattern=r"^[A-Za-z_][\w.\-/]*$")
    direction: Literal["minimize", "maximize"] = "minimize"
    goal: float | None = None
    strategy: Literal["latest", "min", "max"] = "latest"
    additional_metrics: list[str] = Field(default_factory=list, max_length=MAX_PARAMETERS)


class FloatParam(_Strict):
    """A float parameter in ``[low, high]``, optionally log-scaled or quantized by ``step``."""

    type: Literal["float"]
    low: float
    high: float
    log: bool = False
    step: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _check_range(self) -> FloatParam:
        if not (math.isfinite(self.low) and math.isfinite(self.high)):
            raise ValueError("low and high must be finite numbers")
        if self.low >= self.high:
            raise ValueError(f"empty range: low ({self.low}) must be < high ({self.high})")
        if self.log and self.low <= 0:
            raise ValueError(f"low ({self.low}) must be > 0 when log: true")
        if self.log and self.step is not None:
            raise ValueError("step and log: true cannot be combined; drop one")
        if self.step is not None and self.step > self.high - self.low:
            raise ValueError(f"step ({self.step}) must be <= high - low ({self.high - self.low})")
        return self


class IntParam(_Strict):
    """An integer parameter in ``[low, high]`` with ``step`` (default 1), optionally log-scaled."""

    type: Literal["int"]
    low: int
    high: int
    step: int = Field(default=1, ge=1)
    log: bool = False

    @model_validator(mode="after")
    def _check_range(self) -> IntParam:
        if self.low > self.high:
            raise ValueError(f"empty range: low ({self.low}) must be <= high ({self.high})")
        if self.log and self.low < 1:
            raise ValueError(f"low ({self.low}) must be >= 1 when log: true")
        if self.log and self.step != 1:
            raise ValueError("step and log: true cannot be combined; drop one")
        return self


class CategoricalParam(_Strict):
    """A parameter taking one of ``choices`` (strings, numbers, booleans)."""

    type: Literal["categorical"]
    choices: list[str | bool | int | float] = Field(min_length=1, max_length=MAX_CHOICES)

    @model_validator(mode="after")
    def _check_unique(self) -> CategoricalParam:
        seen = [json.dumps(c) for c in self.choices]
        if len(set(seen)) != len(seen):
            raise ValueError(f"choices must be unique; got {self.choices}")
        return self


Parameter = Annotated[FloatParam | IntParam | CategoricalParam, Field(discriminator="type")]


class AlgorithmSpec(BaseModel):
    """The search algorithm; extra keys are passed to the Optuna sampler as options."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: Literal["random", "grid", "tpe", "cmaes", "qmc", "gp"] = "tpe"
    seed: int | None = None

    @property
    def options(self) -> dict[str, Any]:
        """Sampler options: every key besides ``name`` and ``seed``."""
        return dict(self.model_extra or {})


class EarlyStoppingSpec(BaseModel):
    """The early-stopping rule; extra keys are passed to the Optuna pruner as options."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: Literal["none", "median", "percentile", "asha", "hyperband"] = "none"

    @property
    def options(self) -> dict[str, Any]:
        """Pruner options: every key besides ``name``."""
        return dict(self.model_extra or {})


class TrialSpec(_Strict):
    """How one trial runs.

    Attributes:
        command: shell command; ``${param}`` placeholders are replaced by the shell-quoted
            parameter values, and ``${trial_number}``, ``${trial_dir}``, ``${experiment}``
            by the trial's number, its own directory and the experiment name.
        workdir: working directory of the command (relative to where the controller runs).
        env: extra environment variables.
        timeout: seconds after which a trial is stopped and failed (``None``: no limit).
        retries: how many times a failed trial is run again with the same parameters.
        kill_grace: seconds between SIGTERM and SIGKILL when a trial is stopped.
    """

    command: str = Field(min_length=1, max_length=MAX_COMMAND)
    workdir: str = "."
    env: dict[str, str] = Field(default_factory=dict, max_length=MAX_PARAMETERS)
    timeout: float | None = Field(default=None, gt=0, le=MAX_SECONDS)
    retries: int = Field(default=0, ge=0, le=MAX_RETRIES)
    kill_grace: float = Field(default=10.0, ge=0, le=3600)

    @model_validator(mode="after")
    def _check_runnable(self) -> TrialSpec:
        # What the OS cannot pass to a process (execve): refused here, not by a worker
        # that dies after the experiment was created.
        for field in ("command", "workdir"):
            _no_nul(f"trial.{field}", getattr(self, field))
        for name, value in self.env.items():
            if not name or "=" in name or "\0" in name:
                raise _FieldError(f"trial.env.{json.dumps(name)[1:-1]}",
                                  "an environment variable name must be non-empty and "
                                  "hold neither '=' nor a NUL character", name)
            _no_nul(f"trial.env.{json.dumps(name)[1:-1]}", value)
        return self


class ResourcesSpec(_Strict):
    """A pool of GPU indices shared by the parallel trials of one controller.

    Each trial gets ``gpus_per_trial`` indices of ``gpus`` in ``CUDA_VISIBLE_DEVICES``;
    fewer free indices than that holds the next trial back.
    """

    gpus: list[Annotated[int, Field(ge=0, le=MAX_GPU_INDEX)]] = Field(
        default_factory=list, max_length=MAX_GPU_INDEX + 1)
    gpus_per_trial: int = Field(default=1, ge=1, le=MAX_GPU_INDEX + 1)

    @model_validator(mode="after")
    def _check_pool(self) -> ResourcesSpec:
        if len(set(self.gpus)) != len(self.gpus):
            raise ValueError(f"gpus must be unique; got {self.gpus}")
        if self.gpus and len(self.gpus) < self.gpus_per_trial:
            raise ValueError(
                f"gpus_per_trial ({self.gpus_per_trial}) exceeds the pool size ({len(self.gpus)})"
            )
        return self


class DurabilitySpec(_Strict):
    """Lease timing (seconds). Short values suit tests; defaults suit real training jobs.

    Attributes:
        heartbeat_interval: how often a controller renews the leases of its trials.
        lease_duration: how long a lease lives without renewal; after that the trial is
            considered abandoned (its controller died) and another controller retries it.
        poll_interval: how often the controller reads trial output and checks processes.
    """

    heartbeat_interval: float = Field(default=10.0, gt=0, le=3600)
    lease_duration: float = Field(default=60.0, gt=0, le=24 * 3600)
    poll_interval: float = Field(default=0.2, gt=0, le=60)

    @model_validator(mode="after")
    def _check_lease(self) -> DurabilitySpec:
        if self.lease_duration < 2 * self.heartbeat_interval:
            raise ValueError(
                f"lease_duration ({self.lease_duration}) must be >= 2 x heartbeat_interval "
                f"({self.heartbeat_interval}) so one late heartbeat does not lose the lease"
            )
        return self


class ExperimentSpec(_Strict):
    """A whole experiment. See the module docstring and ``docs/hpo.md`` for every field."""

    name: str = Field(pattern=_NAME)
    objective: ObjectiveSpec
    parameters: dict[str, Parameter] = Field(min_length=1, max_length=MAX_PARAMETERS)
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    early_stopping: EarlyStoppingSpec = Field(default_factory=EarlyStoppingSpec)
    trial: TrialSpec
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    durability: DurabilitySpec = Field(default_factory=DurabilitySpec)
    parallel_trials: int = Field(default=1, ge=1, le=MAX_PARALLEL)
    max_trials: int = Field(ge=1, le=MAX_TRIALS)
    max_failed_trials: int = Field(default=3, ge=0, le=MAX_TRIALS)
    output_dir: str = "hpo-runs"

    @model_validator(mode="after")
    def _check_names(self) -> ExperimentSpec:
        _no_nul("output_dir", self.output_dir)
        for name in self.parameters:
            if not _IDENT.match(name) or name in BUILTIN_PLACEHOLDERS:
                raise _FieldError(
                    f"parameters.{name}", f"parameter name {name!r} must be an identifier "
                    f"and not one of {', '.join(BUILTIN_PLACEHOLDERS)}", name)
        allowed = set(self.parameters) | set(BUILTIN_PLACEHOLDERS)
        for used in _PLACEHOLDER.findall(self.trial.command):
            if used not in allowed:
                raise _FieldError(
                    "trial.command", f"placeholder ${{{used}}} is not a parameter; "
                    f"allowed: {', '.join(sorted(allowed))}", self.trial.command)
        quoted = quoted_placeholders(self.trial.command)
        if quoted:
            used, quote = quoted[0]
            raise _FieldError(
                "trial.command", f"placeholder ${{{used}}} is inside {quote} quotes; its "
                "value is shell-quoted already, and quoting it again would let a value "
                "escape its quotes: remove the quotes around it", self.trial.command)
        return self

    def search_fields(self) -> dict[str, Any]:
        """The fields that define the search; they must match when an experiment resumes.

        Returns:
            A JSON-able dict; per-machine fields (workdir, parallelism, timing) are left out
            so workers on different machines may differ in them.
        """
        data = self.model_dump(mode="json")
        return {
            key: data[key]
            for key in ("objective", "parameters", "algorithm", "early_stopping", "max_trials",
                        "max_failed_trials")
        } | {"retries": data["trial"]["retries"]}


def _no_nul(field: str, value: str) -> None:
    if "\0" in value:
        raise _FieldError(field, "must not hold a NUL character (no process or path can take it)", value)


def render_command(command: str, values: Mapping[str, str]) -> str:
    """Replace every ``${name}`` in ``command`` by ``values[name]`` (already shell-quoted).

    Only the ``${name}`` form is a placeholder, so ``$HOME`` and ``$(...)`` reach the shell
    untouched.
    """
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], command)


_PARAM_TYPES = ("float", "int", "categorical")


def _format_error(err: ValidationError) -> str:
    first = err.errors()[0]
    # Discriminated unions add the tag (e.g. "float") to the location; users never wrote it.
    loc = ".".join(str(p) for p in first["loc"] if p not in _PARAM_TYPES)
    msg = first["msg"].removeprefix("Value error, ")
    value = first.get("input")
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, _FieldError):
        loc, value = cause.field, cause.value
    if first["type"] == "extra_forbidden":
        msg = "unknown field"
    elif first["type"] in ("union_tag_invalid", "union_tag_not_found"):
        loc, value = f"{loc}.type", value.get("type") if isinstance(value, dict) else value
        msg = f"unknown parameter type; use one of {', '.join(_PARAM_TYPES)}"
    shown = json.dumps(value, default=str)
    more = f" (and {err.error_count() - 1} more errors)" if err.error_count() > 1 else ""
    where = f"field '{loc}'" if loc else "spec"
    return f"invalid experiment spec: {where}: {msg}; got {shown[:80]}{more}"


def validate_spec(data: Any) -> ExperimentSpec:
    """Validate a spec's fields (not its algorithm options; see the module docstring).

    Args:
        data: the parsed spec, e.g. the result of ``yaml.safe_load``.

    Returns:
        The validated :class:`ExperimentSpec`.

    Raises:
        SpecError: one line naming the first malformed field, its value and what is allowed.
    """
    if not isinstance(data, dict):
        raise SpecError(f"invalid experiment spec: must be a mapping; got {type(data).__name__}")
    try:
        return ExperimentSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(_format_error(exc)) from None
