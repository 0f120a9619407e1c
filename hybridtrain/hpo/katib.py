"""Katib ``kubeflow.org/v1beta1`` ``Experiment`` documents → our experiment spec.

``hybridtrain hpo run experiment.yaml`` accepts a Katib Experiment as it is:
:func:`is_katib` recognises one by ``apiVersion``/``kind`` and :func:`katib_to_spec`
translates it, purely (no I/O), into the dict of an :class:`ExperimentSpec`. The trial is
the primary container's ``command`` + ``args``, run locally through ``/bin/sh`` with every
``${trialParameters.NAME}`` replaced as Katib would; the image and the rest of the pod are
ignored, which the returned notes say in one line.

What maps where (``docs/hpo.md`` has the table): objective → ``objective`` (Katib's default
metric strategy, ``min``/``max`` by objective type, included); ``algorithmName`` and its
``algorithmSettings`` → our sampler and options; ``hyperband`` → random sampling with
Optuna's Hyperband pruner; ``medianstop`` → the median pruner. A setting without an
equivalent is refused in one line naming it, never dropped silently.

The algorithm tables are shared with :mod:`hybridtrain.hpo.katib_export`, so both directions
agree on names.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from hybridtrain.hpo.errors import SpecError
from hybridtrain.hpo.schema import BUILTIN_PLACEHOLDERS, MAX_TRIALS

API_VERSION = "kubeflow.org/v1beta1"
KIND = "Experiment"
#: Katib's own default of ``parallelTrialCount``.
DEFAULT_PARALLEL = 3
#: Katib's defaults of the median-stop settings.
MEDIANSTOP_DEFAULTS = {"min_trials_required": 3, "start_step": 4}

_SPEC_KEYS = {"parameters", "objective", "algorithm", "earlyStopping", "trialTemplate",
              "parallelTrialCount", "maxTrialCount", "maxFailedTrialCount",
              "metricsCollectorSpec", "nasConfig", "resumePolicy"}
_TRIAL_PARAM = re.compile(r"\$\{trialParameters\.([^}]*)\}")
_LABEL_REF = re.compile(r"^\$\{trialSpec\.(Labels|Annotations)\[(.+)\]\}$")
_INT = re.compile(r"^[+-]?\d+$")


def _seed(value: str) -> int:
    return int(value)


def _restart(value: str) -> None:
    # Optuna >= 4.4 dropped CMA-ES restarts (the option falls back to none with a
    # FutureWarning), so any valid value is accepted and the note says it has no effect.
    if value not in ("ipop", "bipop", "none", "None"):
        raise ValueError("allowed: ipop, bipop, none")


def _gp_only(value: str) -> None:
    if value.upper() != "GP":
        raise ValueError("only GP (a Gaussian process) has an equivalent")


# Katib setting -> (our option, converter); option None: accepted, nothing to set.
Settings = dict[str, tuple[str | None, Callable[[str], Any]]]
_TPE: Settings = {"random_state": ("seed", _seed), "n_startup_trials": ("n_startup_trials", int),
                  "n_ei_candidates": ("n_ei_candidates", int),
                  "n_EI_candidates": ("n_ei_candidates", int),
                  "prior_weight": ("prior_weight", float)}
#: Settings accepted although they change nothing here, with the reason for the note.
_NO_EFFECT = {("cmaes", "restart_strategy"): "Optuna >= 4.4 has no CMA-ES restarts"}
#: Katib algorithm -> (our algorithm, fixed options, settings it may carry).
ALGORITHMS: dict[str, tuple[str, dict[str, Any], Settings]] = {
    "random": ("random", {}, {"random_state": ("seed", _seed)}),
    "grid": ("grid", {}, {"random_state": ("seed", _seed)}),
    "tpe": ("tpe", {}, _TPE),
    "multivariate-tpe": ("tpe", {"multivariate": True}, _TPE),
    "cmaes": ("cmaes", {}, {"random_state": ("seed", _seed), "sigma": ("sigma0", float),
                            "restart_strategy": (None, _restart)}),
    "sobol": ("qmc", {"qmc_type": "sobol"}, {"random_state": ("seed", _seed)}),
    "bayesianoptimization": ("gp", {}, {"random_state": ("seed", _seed),
                                        "n_initial_points": ("n_startup_trials", int),
                                        "base_estimator": (None, _gp_only)}),
}
_HYPERBAND_SETTINGS = ("resource_name", "eta", "r_l")


def _err(field: str, message: str, value: Any) -> SpecError:
    shown = repr(value)
    return SpecError(f"invalid Katib experiment: field '{field}': {message}; "
                     f"got {shown[:80]}")


def is_katib(data: Any) -> bool:
    """Whether ``data`` (a parsed document) claims to be a Kubernetes object (Katib's).

    Our own specs have neither ``apiVersion`` nor ``kind``, so either key means the
    document is meant as a Katib Experiment; :func:`katib_to_spec` then checks which.
    """
    return isinstance(data, Mapping) and ("apiVersion" in data or "kind" in data)


def _get(obj: Any, field: str, kind: type | tuple[type, ...], required: bool = True,
         default: Any = None) -> Any:
    """``obj[last part of field]`` checked to be of ``kind``; ``field`` names it in errors."""
    key = field.rsplit(".", 1)[-1]
    if not isinstance(obj, Mapping) or key not in obj or obj[key] is None:
        if required:
            raise _err(field, "required", None)
        return default
    value = obj[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # YAML's true/false are ints to isinstance; never a count or a number here.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise _err(field, f"must be a {names}", value)
    return value


def _number(field: str, value: Any, integer: bool) -> int | float:
    """A Katib number (a string such as ``"0.01"``, or a YAML number)."""
    text = str(value).strip()
    try:
        if integer:
            if not _INT.match(text):
                raise ValueError
            return int(text)
        return float(text)
    except ValueError:
        raise _err(field, "must be an integer" if integer else "must be a number",
                   value) from None


def _choice(text: str) -> int | float:
    return int(text) if _INT.match(text) else float(text)


def _param_name(katib_name: str, field: str) -> str:
    """Our identifier for a Katib parameter name (``num-epochs`` → ``num_epochs``)."""
    name = re.sub(r"\W", "_", katib_name)
    if name[:1].isdigit():
        name = "_" + name
    if name in BUILTIN_PLACEHOLDERS:
        raise _err(field, f"parameter name is reserved here; avoid "
                          f"{', '.join(BUILTIN_PLACEHOLDERS)}", katib_name)
    return name


def _parameter(item: Any, field: str) -> dict[str, Any]:
    """One Katib ``ParameterSpec`` as our parameter."""
    ptype = _get(item, f"{field}.parameterType", str)
    space = _get(item, f"{field}.feasibleSpace", Mapping)
    fs = f"{field}.feasibleSpace"
    dist = space.get("distribution") or "uniform"
    if dist not in ("uniform", "logUniform"):
        raise _err(f"{fs}.distribution", "no equivalent (Optuna samples uniformly or "
                   "log-uniformly); allowed: uniform, logUniform", dist)
    if ptype in ("categorical", "discrete"):
        values = _get(space, f"{fs}.list", list)
        if not values:
            raise _err(f"{fs}.list", "must not be empty", values)
        if ptype == "categorical":
            return {"type": "categorical", "choices": [str(v) for v in values]}
        choices = []
        for v in values:
            _number(f"{fs}.list", v, False)  # refuses a value that is not a number
            choices.append(_choice(str(v).strip()))
        return {"type": "categorical", "choices": choices}
    if ptype not in ("double", "int"):
        raise _err(f"{field}.parameterType", "allowed: double, int, categorical, discrete",
                   ptype)
    integer = ptype == "int"
    low = _number(f"{fs}.min", _get(space, f"{fs}.min", (str, int, float)), integer)
    high = _number(f"{fs}.max", _get(space, f"{fs}.max", (str, int, float)), integer)
    out: dict[str, Any] = {"type": "int" if integer else "float", "low": low, "high": high}
    if space.get("step") not in (None, ""):
        out["step"] = _number(f"{fs}.step", space["step"], integer)
    if dist == "logUniform":
        if "step" in out:
            raise _err(f"{fs}.step", "cannot be combined with distribution logUniform "
                       "here; drop one", space["step"])
        out["log"] = True
    return out


def _settings(algo: Mapping[str, Any], field: str) -> Iterator[tuple[str, str, str]]:
    """``(name, value, field)`` of each ``algorithmSettings`` entry."""
    items = _get(algo, f"{field}.algorithmSettings", list, required=False, default=[])
    for i, item in enumerate(items):
        name = _get(item, f"{field}.algorithmSettings[{i}].name", str)
        value = item.get("value")
        yield name, "" if value is None else str(value), f"{field}.algorithmSettings.{name}"


def _algorithm(spec: Mapping[str, Any], params: dict[str, dict[str, Any]],
               names: dict[str, str], notes: list[str]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Our ``algorithm`` and, for ``hyperband``, the ``early_stopping`` it implies."""
    algo = _get(spec, "spec.algorithm", Mapping)
    name = _get(algo, "spec.algorithm.algorithmName", str)
    if name == "hyperband":
        return {"name": "random"}, _hyperband(algo, params, names)
    if name not in ALGORITHMS:
        raise _err("spec.algorithm.algorithmName", "no hybridtrain equivalent; allowed: "
                   f"{', '.join([*ALGORITHMS, 'hyperband'])}", name)
    ours, fixed, table = ALGORITHMS[name]
    out: dict[str, Any] = {"name": ours, **fixed}
    for key, value, field in _settings(algo, "spec.algorithm"):
        if key not in table:
            raise _err(field, f"no hybridtrain equivalent for {name}; allowed: "
                       f"{', '.join(table) or 'none'}", value)
        option, convert = table[key]
        try:
            converted = convert(value)
        except ValueError as exc:
            raise _err(field, str(exc) or "not a valid value", value) from None
        if option is not None and converted is not None:
            out[option] = converted
        if (name, key) in _NO_EFFECT and value not in ("none", "None"):
            notes.append(f"Katib setting {key}={value} of {name} has no effect: "
                         f"{_NO_EFFECT[name, key]}")
    return out, None


def _hyperband(algo: Mapping[str, Any], params: dict[str, dict[str, Any]],
               names: dict[str, str]) -> dict[str, Any]:
    """Katib's Hyperband as Optuna's Hyperband pruner.

    Katib runs each bracket's trials with the ``resource_name`` parameter set to their
    budget. Here every trial gets the full budget ``r_l`` and the pruner stops the
    unpromising ones from their reported learning curves: the same successive halving
    with rate ``eta``, driven by intermediate values instead of separate trials.
    """
    settings = {key: (value, field) for key, value, field in _settings(algo, "spec.algorithm")}
    for key, (value, field) in settings.items():
        if key not in _HYPERBAND_SETTINGS:
            raise _err(field, f"no hybridtrain equivalent for hyperband; allowed: "
                       f"{', '.join(_HYPERBAND_SETTINGS)}", value)
    for key in _HYPERBAND_SETTINGS:
        if key not in settings:
            raise _err(f"spec.algorithm.algorithmSettings.{key}", "required for hyperband",
                       None)
    resource, field = settings["resource_name"]
    if resource not in names:
        raise _err(field, f"must name a parameter; allowed: {', '.join(names)}", resource)
    eta = _number(settings["eta"][1], settings["eta"][0], True)
    r_l = _number(settings["r_l"][1], settings["r_l"][0], False)
    budget = int(r_l) if params[names[resource]]["type"] == "int" else r_l
    params[names[resource]] = {"type": "categorical", "choices": [budget]}
    return {"name": "hyperband", "reduction_factor": eta, "min_resource": 1,
            "max_resource": max(int(r_l), 1)}


def _early_stopping(spec: Mapping[str, Any]) -> dict[str, Any] | None:
    es = _get(spec, "spec.earlyStopping", Mapping, required=False)
    if es is None:
        return None
    name = _get(es, "spec.earlyStopping.algorithmName", str)
    if name != "medianstop":
        raise _err("spec.earlyStopping.algorithmName", "no hybridtrain equivalent; "
                   "allowed: medianstop", name)
    values: dict[str, int] = dict(MEDIANSTOP_DEFAULTS)
    for key, value, field in _settings(es, "spec.earlyStopping"):
        if key not in values:
            raise _err(field, f"unknown medianstop setting; allowed: {', '.join(values)}",
                       value)
        values[key] = _number(field, value, True)  # type: ignore[assignment]
        if values[key] < 1:
            raise _err(field, "must be >= 1", value)
    # Katib starts judging a trial once it reported start_step values; our steps count
    # from 0 (the n-th value has step n-1) and Optuna judges from step n_warmup_steps.
    return {"name": "median", "n_startup_trials": values["min_trials_required"],
            "n_warmup_steps": values["start_step"] - 1}


def _objective(spec: Mapping[str, Any]) -> dict[str, Any]:
    obj = _get(spec, "spec.objective", Mapping)
    direction = _get(obj, "spec.objective.type", str)
    if direction not in ("minimize", "maximize"):
        raise _err("spec.objective.type", "allowed: minimize, maximize", direction)
    metric = _get(obj, "spec.objective.objectiveMetricName", str)
    # Katib's default strategy of the objective metric: its best value over the trial.
    strategy = "min" if direction == "minimize" else "max"
    for i, item in enumerate(_get(obj, "spec.objective.metricStrategies", list,
                                  required=False, default=[])):
        if isinstance(item, Mapping) and item.get("name") == metric:
            if item.get("value") not in ("min", "max", "latest"):
                raise _err(f"spec.objective.metricStrategies[{i}].value",
                           "allowed: min, max, latest", item.get("value"))
            strategy = str(item["value"])
    out: dict[str, Any] = {"metric": metric, "direction": direction, "strategy": strategy}
    if obj.get("goal") is not None:
        out["goal"] = _number("spec.objective.goal", obj["goal"], False)
    extra = _get(obj, "spec.objective.additionalMetricNames", list, required=False)
    if extra:
        out["additional_metrics"] = [str(m) for m in extra]
    return out


def _check_collector(spec: Mapping[str, Any]) -> None:
    mc = _get(spec, "spec.metricsCollectorSpec", Mapping, required=False, default={})
    kind = (mc.get("collector") or {}).get("kind", "StdOut")
    if kind != "StdOut":
        raise _err("spec.metricsCollectorSpec.collector.kind", "only StdOut (name=value "
                   "lines on stdout) has an equivalent; allowed: StdOut", kind)
    if (mc.get("source") or {}).get("filter"):
        raise _err("spec.metricsCollectorSpec.source.filter", "custom metric formats "
                   "have no equivalent (name=value lines are read); remove it",
                   mc["source"]["filter"])


def _containers(node: Any) -> Iterator[Mapping[str, Any]]:
    """Every container of a trial spec (Job, PyTorchJob, TFJob …: any ``containers``)."""
    if isinstance(node, Mapping):
        for key, value in node.items():
            if key == "containers" and isinstance(value, list):
                yield from (c for c in value if isinstance(c, Mapping))
            else:
                yield from _containers(value)
    elif isinstance(node, list):
        for value in node:
            yield from _containers(value)


def _reference(ref: str, field: str, trial_spec: Mapping[str, Any], namespace: str,
               names: dict[str, str]) -> str:
    """The shell fragment a trial parameter's ``reference`` stands for."""
    if ref in names:
        return "${" + names[ref] + "}"
    meta = trial_spec.get("metadata") or {}
    literal = {"${trialSpec.Name}": None, "${trialSpec.Namespace}": namespace,
               "${trialSpec.Kind}": trial_spec.get("kind"),
               "${trialSpec.APIVersion}": trial_spec.get("apiVersion")}
    if ref == "${trialSpec.Name}":
        # Katib names a trial after its experiment; ours are numbered.
        return "${experiment}-${trial_number}"
    if ref in literal and literal[ref] is not None:
        return shlex.quote(str(literal[ref]))
    if m := _LABEL_REF.match(ref):
        table = meta.get(m.group(1).lower()) or {}
        if m.group(2) in table:
            return shlex.quote(str(table[m.group(2)]))
        raise _err(field, f"the trial spec's metadata has no {m.group(1)[:-1].lower()} "
                   f"{m.group(2)!r}", ref)
    raise _err(field, "must be a parameter name or ${trialSpec.Name|Namespace|Kind|"
               f"APIVersion|Labels[k]|Annotations[k]}}; parameters: {', '.join(names)}", ref)


def _shell_word(text: str, fragments: Mapping[str, str], field: str) -> str:
    """``text`` (one argv word) as shell text: literal parts quoted, placeholders bare.

    A placeholder's value is shell-quoted when the trial starts, so it must stand
    outside quotes; ``'--lr='${lr}`` is still one word to the shell.
    """
    parts, pos = [], 0
    for m in _TRIAL_PARAM.finditer(text):
        if m.start() > pos:
            parts.append(shlex.quote(text[pos:m.start()]))
        if m.group(1) not in fragments:
            raise _err(field, f"${{trialParameters.{m.group(1)}}} is not a trial parameter; "
                       f"allowed: {', '.join(fragments) or 'none'}", text)
        parts.append(fragments[m.group(1)])
        pos = m.end()
    if pos < len(text) or not parts:
        parts.append(shlex.quote(text[pos:]))
    return "".join(parts)


def _trial(spec: Mapping[str, Any], namespace: str, names: dict[str, str],
           notes: list[str]) -> dict[str, Any]:
    """Our ``trial``: the primary container's command, run locally."""
    tt = _get(spec, "spec.trialTemplate", Mapping)
    if tt.get("configMap") is not None:
        raise _err("spec.trialTemplate.configMap", "a trial template in a ConfigMap cannot "
                   "be read locally; inline it as trialSpec", tt["configMap"])
    trial_spec = _get(tt, "spec.trialTemplate.trialSpec", Mapping)
    primary = _get(tt, "spec.trialTemplate.primaryContainerName", str)
    fragments: dict[str, str] = {}
    for i, item in enumerate(_get(tt, "spec.trialTemplate.trialParameters", list,
                                  required=False, default=[])):
        field = f"spec.trialTemplate.trialParameters[{i}]"
        tp_name = _get(item, f"{field}.name", str)
        ref = _get(item, f"{field}.reference", str, required=False, default=tp_name)
        fragments[tp_name] = _reference(ref, f"{field}.reference", trial_spec, namespace,
                                        names)
    found = [c for c in _containers(trial_spec) if c.get("name") == primary]
    if not found:
        raise _err("spec.trialTemplate.primaryContainerName", "no container of trialSpec "
                   "has this name", primary)
    container, field = found[0], "spec.trialTemplate.trialSpec…containers." + primary
    argv = [*(container.get("command") or []), *(container.get("args") or [])]
    if not argv:
        raise _err(f"{field}.command", "needed: the image's own entrypoint cannot run "
                   "locally; give command (and args)", None)
    words = [_shell_word(str(w), fragments, f"{field}.command") for w in argv]
    env: dict[str, str] = {}
    ignored = []
    for item in container.get("env") or []:
        if not isinstance(item, Mapping) or "value" not in item:
            ignored.append(f"env {item.get('name') if isinstance(item, Mapping) else item}")
        elif _TRIAL_PARAM.search(str(item["value"])):
            # Environment values with placeholders become assignments before the command.
            words.insert(0, f"{item['name']}=" + _shell_word(str(item["value"]), fragments,
                                                             f"{field}.env"))
        else:
            env[str(item["name"])] = str(item["value"])
    ignored += [k for k in ("workingDir", "resources", "volumeMounts") if container.get(k)]
    notes.append(f"Katib trial: the command of container {primary!r} runs locally; its "
                 f"image {container.get('image', '(none)')!r} is ignored"
                 + (f", and so are its {', '.join(ignored)}" if ignored else ""))
    return {"command": " ".join(words), "env": env}


def katib_to_spec(doc: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Translate a Katib ``kubeflow.org/v1beta1`` Experiment into our spec's fields.

    Pure: no files, processes or storage are touched, so it is unit-testable and
    deterministic (rerunning a Katib file resumes the same experiment).

    Args:
        doc: the parsed Katib document.

    Returns:
        ``(spec dict, notes)``: the dict for :func:`hybridtrain.hpo.spec.load_spec`, and
        informational lines (what of the Kubernetes document is ignored or renamed).

    Raises:
        SpecError: one line naming the Katib field, its value and what is allowed.
    """
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != KIND:
        raise _err("apiVersion/kind", f"only {API_VERSION} {KIND} is understood",
                   f"{doc.get('apiVersion')} {doc.get('kind')}")
    name = _get(_get(doc, "metadata", Mapping), "metadata.name", str)
    namespace = str((doc.get("metadata") or {}).get("namespace") or "default")
    spec = _get(doc, "spec", Mapping)
    for key in spec:
        if key not in _SPEC_KEYS:
            raise _err(f"spec.{key}", f"unknown field; allowed: {', '.join(sorted(_SPEC_KEYS))}",
                       spec[key])
    if spec.get("nasConfig"):
        raise _err("spec.nasConfig", "neural architecture search has no hybridtrain "
                   "equivalent", "…")
    notes: list[str] = []
    names: dict[str, str] = {}
    params: dict[str, dict[str, Any]] = {}
    items = _get(spec, "spec.parameters", list)
    for i, item in enumerate(items):
        katib_name = _get(item, f"spec.parameters[{i}].name", str)
        field = f"spec.parameters.{katib_name}"
        ours = _param_name(katib_name, field)
        if ours in params:
            raise _err(field, f"two parameters would both be called {ours!r} here", katib_name)
        names[katib_name] = ours
        params[ours] = _parameter(item, field)
    renamed = [f"{k} → {v}" for k, v in names.items() if k != v]
    if renamed:
        notes.append(f"Katib parameters renamed to identifiers: {', '.join(renamed)}")
    _check_collector(spec)
    algorithm, implied = _algorithm(spec, params, names, notes)
    early = _early_stopping(spec)
    if implied and early:
        raise _err("spec.earlyStopping", "cannot be combined with algorithm hyperband, "
                   "which is early stopping already", early["name"])
    max_trials = _get(spec, "spec.maxTrialCount", int, required=False)
    if max_trials is None:
        raise _err("spec.maxTrialCount", "required here (the number of trials to run)", None)
    failed = _get(spec, "spec.maxFailedTrialCount", int, required=False)
    out: dict[str, Any] = {
        "name": name,
        "objective": _objective(spec),
        "parameters": params,
        "algorithm": algorithm,
        "trial": _trial(spec, namespace, names, notes),
        "parallel_trials": _get(spec, "spec.parallelTrialCount", int, required=False,
                                default=DEFAULT_PARALLEL),
        "max_trials": max_trials,
        # Katib fails the experiment when failures reach the count; we when they exceed it.
        "max_failed_trials": MAX_TRIALS if failed is None else max(failed - 1, 0),
    }
    if implied or early:
        out["early_stopping"] = implied or early
    return out, notes
