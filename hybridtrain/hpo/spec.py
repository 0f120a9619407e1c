"""Loading an experiment spec: the public entry point for specs.

:func:`load_spec` reads a YAML/JSON file (or takes a mapping), validates its fields against
the models of :mod:`hybridtrain.hpo.schema` (see there for the format) and checks the
algorithm and early-stopping options by building their Optuna objects
(:mod:`hybridtrain.hpo.algorithms`), so any malformed field becomes a one-line
:class:`SpecError` that names the field, the value and what is allowed, before anything is
started or written.

The models live in :mod:`~hybridtrain.hpo.schema` rather than here so that
:mod:`~hybridtrain.hpo.algorithms` can use them without importing this module, which
imports it (layering: schema ← algorithms ← spec). They are re-exported here, so
``from hybridtrain.hpo.spec import ExperimentSpec`` keeps working.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from hybridtrain.bounded_parse import TooLargeError, check_bounds, load_yaml
from hybridtrain.hpo.algorithms import check_algorithms
from hybridtrain.hpo.errors import SpecError
from hybridtrain.hpo.katib import is_katib, katib_to_spec
from hybridtrain.hpo.schema import (
    BUILTIN_PLACEHOLDERS,
    AlgorithmSpec,
    CategoricalParam,
    DurabilitySpec,
    EarlyStoppingSpec,
    ExperimentSpec,
    FloatParam,
    IntParam,
    ObjectiveSpec,
    Parameter,
    ResourcesSpec,
    TrialSpec,
    render_command,
    validate_spec,
)

__all__ = [
    "BUILTIN_PLACEHOLDERS",
    "AlgorithmSpec",
    "CategoricalParam",
    "DurabilitySpec",
    "EarlyStoppingSpec",
    "ExperimentSpec",
    "FloatParam",
    "IntParam",
    "ObjectiveSpec",
    "Parameter",
    "ResourcesSpec",
    "TrialSpec",
    "load_spec",
    "render_command",
]


def load_spec(source: str | Path | Mapping[str, Any],
              notes: list[str] | None = None) -> ExperimentSpec:
    """Load and validate an experiment spec, or a Katib ``Experiment`` translated into one.

    Args:
        source: a path to a YAML/JSON file, or the spec as a mapping. A document with
            ``apiVersion``/``kind`` is read as a Katib ``kubeflow.org/v1beta1`` Experiment
            (:mod:`hybridtrain.hpo.katib`).
        notes: if given, informational lines of a Katib translation are appended to it
            (what was ignored or renamed).

    Returns:
        The validated :class:`ExperimentSpec`, with algorithm and early-stopping options
        checked against the Optuna classes they configure.

    Raises:
        SpecError: one line naming the first malformed field, its value and what is allowed.
    """
    try:
        if isinstance(source, Mapping):
            data: Any = dict(check_bounds(source, "the spec"))
        else:
            path = Path(source)
            data = load_yaml(path.read_text(), f"spec file {str(path)!r}")
    except TooLargeError as exc:
        raise SpecError(str(exc)) from None
    except (OSError, yaml.YAMLError) as exc:
        if isinstance(exc, OSError):
            raise SpecError(f"cannot read spec file {str(source)!r}: {exc.strerror}") from None
        line = str(exc).replace("\n", " ")
        raise SpecError(f"spec file {str(source)!r} is not valid YAML/JSON: {line}") from None
    if is_katib(data):
        data, katib_notes = katib_to_spec(data)
        if notes is not None:
            notes.extend(katib_notes)
        try:
            return _checked(data)
        except SpecError as exc:
            raise SpecError(f"{exc} (in the translation of Katib experiment "
                            f"{data.get('name')!r})") from None
    return _checked(data)


def _checked(data: Any) -> ExperimentSpec:
    spec = validate_spec(data)
    check_algorithms(spec)
    return spec
