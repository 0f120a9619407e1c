"""Our experiment spec → a Katib ``kubeflow.org/v1beta1`` Experiment, to move it to a cluster.

:func:`spec_to_katib` is the inverse of :func:`hybridtrain.hpo.katib.katib_to_spec` for
everything Katib can express: importing the exported document gives back the same search
space, objective, algorithm, early stopping and trial counts. The trial becomes a
``batch/v1`` Job whose container (image ``hybridtrain:latest`` unless told otherwise)
runs the spec's trial command through ``sh -c`` with Katib's ``${trialParameters.NAME}``
in place of our ``${NAME}``; its metrics are collected from stdout, where ``hybridtrain
train`` prints Katib-format ``loss=…`` lines. Fields Katib has no equivalent for are
refused in one line naming the field, never dropped silently.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from hybridtrain.hpo.errors import SpecError
from hybridtrain.hpo.katib import (
    ALGORITHMS,
    API_VERSION,
    KIND,
    MEDIANSTOP_DEFAULTS,
    katib_to_spec,
)
from hybridtrain.hpo.schema import MAX_TRIALS, CategoricalParam, ExperimentSpec, FloatParam

#: Image of the exported trials' container unless the caller names another.
DEFAULT_IMAGE = "hybridtrain:latest"
CONTAINER = "training-container"
_PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")
# Katib has no trial number; the trial's name (unique in the experiment) stands in.
_TRIAL_NAME = "trialName"


def _err(field: str, message: str, value: Any) -> SpecError:
    return SpecError(f"cannot export to Katib: field '{field}': {message}; got {value!r}"[:300])


def _num(value: float | int) -> str:
    """A number as Katib writes it: a string (``"0.01"``)."""
    return str(value)


def _parameter(name: str, p: Any) -> dict[str, Any]:
    if isinstance(p, CategoricalParam):
        numeric = all(isinstance(c, int | float) and not isinstance(c, bool)
                      for c in p.choices)
        # Katib values are strings: numbers go to `discrete` (read back as numbers),
        # booleans become the strings a trial command sees anyway ("True").
        return {"name": name, "parameterType": "discrete" if numeric else "categorical",
                "feasibleSpace": {"list": [str(c) for c in p.choices]}}
    space: dict[str, Any] = {"min": _num(p.low), "max": _num(p.high)}
    if p.step is not None and (isinstance(p, FloatParam) or p.step != 1):
        space["step"] = _num(p.step)  # Katib's int step defaults to 1 as ours does
    if p.log:
        space["distribution"] = "logUniform"
    return {"name": name, "parameterType": "double" if isinstance(p, FloatParam) else "int",
            "feasibleSpace": space}


def _algorithm(spec: ExperimentSpec) -> dict[str, Any]:
    algo = spec.algorithm
    options = dict(algo.options)
    katib_name = {"qmc": "sobol", "gp": "bayesianoptimization"}.get(algo.name, algo.name)
    if algo.name == "tpe" and options.pop("multivariate", False):
        katib_name = "multivariate-tpe"
    if algo.name == "qmc" and options.pop("qmc_type", "sobol") != "sobol":
        raise _err("algorithm.qmc_type", "Katib's sobol is the only QMC; allowed: sobol",
                   algo.options.get("qmc_type"))
    _, _, table = ALGORITHMS[katib_name]
    # Our option -> the first Katib setting that maps to it.
    reverse = {option: key for key, (option, _) in reversed(table.items()) if option}
    settings = []
    if algo.seed is not None:
        settings.append({"name": "random_state", "value": str(algo.seed)})
    for key, value in options.items():
        if key not in reverse or key == "seed":
            raise _err(f"algorithm.{key}", f"no Katib setting for {algo.name}; exportable: "
                       f"{', '.join(k for k in reverse if k != 'seed') or 'none'}", value)
        settings.append({"name": reverse[key], "value": str(value)})
    out: dict[str, Any] = {"algorithmName": katib_name}
    if settings:
        out["algorithmSettings"] = settings
    return out


def _early_stopping(spec: ExperimentSpec) -> dict[str, Any] | None:
    es = spec.early_stopping
    if es.name == "none":
        return None
    if es.name != "median":
        raise _err("early_stopping.name", "Katib's early stopping is medianstop only; "
                   "allowed: none, median", es.name)
    options = dict(es.options)
    # Optuna's defaults, spelled out: Katib's differ (3 and 4).
    startup = options.pop("n_startup_trials", 5)
    warmup = options.pop("n_warmup_steps", 0)
    if options:
        key = next(iter(options))
        raise _err(f"early_stopping.{key}", "no medianstop setting; exportable: "
                   "n_startup_trials, n_warmup_steps", options[key])
    settings = {"min_trials_required": max(int(startup), 1), "start_step": int(warmup) + 1}
    assert set(settings) == set(MEDIANSTOP_DEFAULTS)
    return {"algorithmName": "medianstop",
            "algorithmSettings": [{"name": k, "value": str(v)} for k, v in settings.items()]}


def _command(spec: ExperimentSpec) -> str:
    """The trial command with Katib's placeholders (substituted verbatim by Katib)."""
    prefix = f"{spec.output_dir}/{spec.name}/"

    def katib(m: re.Match[str]) -> str:
        name = m.group(1)
        if name == "experiment":
            return spec.name
        if name == "trial_number":
            return f"${{trialParameters.{_TRIAL_NAME}}}"
        if name == "trial_dir":
            return f"{prefix}${{trialParameters.{_TRIAL_NAME}}}"
        return f"${{trialParameters.{name}}}"

    return _PLACEHOLDER.sub(katib, spec.trial.command)


def _job(spec: ExperimentSpec, image: str) -> dict[str, Any]:
    container: dict[str, Any] = {"name": CONTAINER, "image": image,
                                 "command": ["sh", "-c", _command(spec)]}
    env = {"PYTHONUNBUFFERED": "1", **spec.trial.env}
    container["env"] = [{"name": k, "value": v} for k, v in env.items()]
    if spec.trial.workdir != ".":
        container["workingDir"] = spec.trial.workdir
    if spec.resources.gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": spec.resources.gpus_per_trial}}
    job: dict[str, Any] = {"backoffLimit": spec.trial.retries, "template": {"spec": {
        "containers": [container], "restartPolicy": "Never"}}}
    if spec.trial.timeout is not None:
        job["activeDeadlineSeconds"] = int(spec.trial.timeout + 0.999)
    return {"apiVersion": "batch/v1", "kind": "Job", "spec": job}


def spec_to_katib(spec: ExperimentSpec, image: str = DEFAULT_IMAGE,
                  namespace: str | None = None) -> dict[str, Any]:
    """A Katib Experiment running ``spec``'s trials in containers of ``image``.

    Args:
        spec: the experiment spec.
        image: container image that has hybridtrain and the trial's files.
        namespace: Kubernetes namespace of the Experiment (``None``: the cluster default).

    Returns:
        The Experiment as a dict, ready for ``yaml.safe_dump``; checked with
        :func:`check_katib_document`.

    Raises:
        SpecError: a field has no Katib equivalent (one line naming it).
    """
    if not image or any(c.isspace() for c in image):
        raise _err("image", "must be a non-empty image reference without spaces", image)
    obj = spec.objective
    objective: dict[str, Any] = {
        "type": obj.direction, "objectiveMetricName": obj.metric,
        "metricStrategies": [{"name": obj.metric, "value": obj.strategy}]}
    if obj.goal is not None:
        objective["goal"] = obj.goal
    if obj.additional_metrics:
        objective["additionalMetricNames"] = list(obj.additional_metrics)
    used = set(_PLACEHOLDER.findall(spec.trial.command))
    # Katib refuses a trial parameter its template does not use.
    trial_params = [{"name": n, "description": f"parameter {n}", "reference": n}
                    for n in spec.parameters if n in used]
    if used & {"trial_number", "trial_dir"}:
        trial_params.append({"name": _TRIAL_NAME, "description": "the trial's name",
                             "reference": "${trialSpec.Name}"})
    body: dict[str, Any] = {
        "objective": objective,
        "algorithm": _algorithm(spec),
        # Katib's webhook requires both counts <= maxTrialCount (its failed trials count
        # toward it, so failing them all is the most it can tolerate).
        "parallelTrialCount": min(spec.parallel_trials, spec.max_trials),
        "maxTrialCount": spec.max_trials,
        "parameters": [_parameter(n, p) for n, p in spec.parameters.items()],
        "metricsCollectorSpec": {"collector": {"kind": "StdOut"}},
        "trialTemplate": {"primaryContainerName": CONTAINER, "trialParameters": trial_params,
                          "trialSpec": _job(spec, image)},
    }
    if spec.max_failed_trials < MAX_TRIALS:
        # Katib fails an experiment when failures reach the count; we when they exceed it.
        body["maxFailedTrialCount"] = min(spec.max_failed_trials + 1, spec.max_trials)
    if (es := _early_stopping(spec)) is not None:
        body["earlyStopping"] = es
    metadata: dict[str, Any] = {"name": spec.name}
    if namespace:
        metadata["namespace"] = namespace
    doc = {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": body}
    check_katib_document(doc)
    return doc


_K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_TEMPLATE_PARAM = re.compile(r"\$\{trialParameters\.([^}]*)\}")
_META_REF = re.compile(r"^\$\{trialSpec\.(Name|Namespace|Kind|APIVersion|"
                       r"(Labels|Annotations)\[.+\])\}$")


def _invalid(field: str, message: str, value: Any = None) -> SpecError:
    return SpecError(f"invalid Katib experiment: field '{field}': {message}; got {value!r}"[:300])


def _check_counts(spec: Mapping[str, Any]) -> None:
    """Katib's webhook rules on the trial counts."""
    most = spec.get("maxTrialCount")
    if not isinstance(most, int) or most < 1:
        raise _invalid("spec.maxTrialCount", "must be an integer > 0", most)
    for key in ("parallelTrialCount", "maxFailedTrialCount"):
        value = spec.get(key)
        low = 1 if key == "parallelTrialCount" else 0
        if value is not None and (not isinstance(value, int) or not low <= value <= most):
            raise _invalid(f"spec.{key}", f"must be an integer in [{low}, spec.maxTrialCount "
                           f"({most})]", value)


def _check_parameters(spec: Mapping[str, Any]) -> set[str]:
    """Katib's webhook rules on parameters; returns their names."""
    names: set[str] = set()
    params = spec.get("parameters")
    if not isinstance(params, list) or not params:
        raise _invalid("spec.parameters", "a non-empty list is required", params)
    for i, p in enumerate(params):
        field = f"spec.parameters[{i}]"
        space = p.get("feasibleSpace") if isinstance(p, Mapping) else None
        if not isinstance(p, Mapping) or not p.get("name") or not isinstance(space, Mapping):
            raise _invalid(field, "name and feasibleSpace are required", p)
        names.add(p["name"])
        kind = p.get("parameterType")
        if kind in ("double", "int") and (space.get("list") or not space.get("min")
                                          or not space.get("max")):
            raise _invalid(f"{field}.feasibleSpace", f"{kind} needs min and max, no list",
                           space)
        if kind in ("categorical", "discrete") and (
                not space.get("list") or any(space.get(k) for k in ("min", "max", "step"))):
            raise _invalid(f"{field}.feasibleSpace", f"{kind} needs a list and no "
                           "min/max/step", space)
        if kind not in ("double", "int", "categorical", "discrete"):
            raise _invalid(f"{field}.parameterType", "allowed: double, int, categorical, "
                           "discrete", kind)
    return names


def _check_template(template: Any, parameter_names: set[str]) -> None:
    """Katib's webhook rules on the trial template and its trial parameters."""
    field = "spec.trialTemplate"
    if not isinstance(template, Mapping) or not template.get("primaryContainerName"):
        raise _invalid(f"{field}.primaryContainerName", "required", None)
    trial_spec = template.get("trialSpec")
    if not isinstance(trial_spec, Mapping) or not trial_spec.get("apiVersion") \
            or not trial_spec.get("kind"):
        raise _invalid(f"{field}.trialSpec", "required, with apiVersion and kind", trial_spec)
    meta = trial_spec.get("metadata") or {}
    if "name" in meta or "namespace" in meta:
        raise _invalid(f"{field}.trialSpec.metadata", "name and namespace must be omitted",
                       meta)
    used = set(_TEMPLATE_PARAM.findall(json.dumps(trial_spec)))
    declared: set[str] = set()
    refs: set[str] = set()
    for i, tp in enumerate(template.get("trialParameters") or []):
        where = f"{field}.trialParameters[{i}]"
        name, ref = (tp.get("name"), tp.get("reference")) if isinstance(tp, Mapping) else (
            None, None)
        if not name or not ref or "{" in name or "}" in name:
            raise _invalid(where, "name and reference are required; no braces in the name",
                           tp)
        if name in declared or ref in refs:
            raise _invalid(where, "duplicate name or reference", tp)
        if ref not in parameter_names and not _META_REF.match(ref):
            raise _invalid(f"{where}.reference", "must name a parameter or a ${trialSpec…} "
                           "key", ref)
        if name not in used:
            raise _invalid(f"{where}.name", "not used in trialSpec", name)
        declared.add(name)
        refs.add(ref)
    if used - declared:
        raise _invalid(field, "trialSpec uses undeclared trial parameters",
                       sorted(used - declared))


def check_katib_document(doc: Mapping[str, Any]) -> None:
    """Structural check of a Katib Experiment, by the rules of Katib's admission webhook.

    ``kubernetes-validate`` is not a dependency; this checks what Katib's own validator
    (``pkg/webhook/v1beta1/experiment/validator``) requires of the fields we write:
    ``apiVersion``/``kind``, a DNS-1123 ``metadata.name`` of at most 40 characters, the
    objective and algorithm, trial counts, parameters, and a trial template whose trial
    parameters and ``${trialParameters.…}`` uses match. It then translates the document
    back, which checks everything the local runner understands.

    Raises:
        SpecError: one line naming the first missing or malformed field.
    """
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != KIND:
        raise _invalid("apiVersion/kind", f"must be {API_VERSION} {KIND}",
                       f"{doc.get('apiVersion')} {doc.get('kind')}")
    name = (doc.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not _K8S_NAME.match(name) or len(name) > 40:
        raise _invalid("metadata.name", "Katib needs a DNS-1123 label of at most 40 "
                       "characters (lowercase letters, digits, '-')", name)
    spec = doc.get("spec")
    if not isinstance(spec, Mapping):
        raise _invalid("spec", "required", spec)
    obj = spec.get("objective") or {}
    if obj.get("type") not in ("minimize", "maximize") or not obj.get("objectiveMetricName"):
        raise _invalid("spec.objective", "type (minimize/maximize) and objectiveMetricName "
                       "are required", obj)
    if obj.get("objectiveMetricName") in (obj.get("additionalMetricNames") or []):
        raise _invalid("spec.objective.additionalMetricNames", "must not contain the "
                       "objective metric", obj["additionalMetricNames"])
    if not (spec.get("algorithm") or {}).get("algorithmName"):
        raise _invalid("spec.algorithm.algorithmName", "required", None)
    _check_counts(spec)
    _check_template(spec.get("trialTemplate"), _check_parameters(spec))
    katib_to_spec(doc)
