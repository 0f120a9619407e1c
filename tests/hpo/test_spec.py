"""Spec validation: every malformed field gives one line naming it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hybridtrain.hpo.errors import SpecError
from hybridtrain.hpo.spec import load_spec, render_command


def _with(spec: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    node = spec
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value
    return spec


def test_valid_spec_loads_with_defaults(make_spec: Any) -> None:
    spec = load_spec(make_spec())
    assert spec.objective.strategy == "latest"
    assert spec.trial.retries == 0
    assert spec.algorithm.options == {"n_startup_trials": 3}


def test_issue_example_yaml_loads(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text("""
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
  workdir: .
  env: {}
  timeout: 3600
  retries: 1
parallel_trials: 2
max_trials: 20
max_failed_trials: 3
""")
    spec = load_spec(path)
    assert spec.parameters["lr"].log is True  # type: ignore[union-attr]
    assert spec.trial.timeout == 3600


@pytest.mark.parametrize(("path", "value", "expected"), [
    ("name", "has space", "'name'"),
    ("objective.direction", "down", "'objective.direction'"),
    ("objective.strategy", "median", "'objective.strategy'"),
    ("parameters.x1.low", 20.0, "empty range"),
    ("parameters.x1.log", True, "must be > 0 when log"),
    ("parameters.x1.bogus", 1, "'parameters.x1.bogus': unknown field"),
    ("parameters.x2", {"type": "int", "low": 5, "high": 1}, "'parameters.x2'"),
    ("parameters.x2", {"type": "categorical", "choices": []}, "'parameters.x2.choices'"),
    ("parameters.x2", {"type": "categorical", "choices": ["a", "a"]}, "unique"),
    ("algorithm.name", "bayes", "'algorithm.name'"),
    ("algorithm.n_startup", 3, "'algorithm.n_startup': unknown option for tpe"),
    ("early_stopping.name", "asha2", "'early_stopping.name'"),
    ("early_stopping.name", "percentile", "'early_stopping.percentile'"),
    ("trial.command", "run ${lr}", "field 'trial.command': placeholder ${lr} is not a param"),
    ("parameters.trial_dir", {"type": "int", "low": 0, "high": 1}, "'parameters.trial_dir'"),
    ("parameters.x1.type", "floaty", "'parameters.x1.type': unknown parameter type"),
    ("parameters.x1.step", 100.0, "step (100.0) must be <= high - low"),
    ("algorithm.n_startup_trials", "3", "'algorithm': tpe failed a trial run"),
    ("trial.command", "", "'trial.command'"),
    ("trial.timeout", -1, "'trial.timeout'"),
    ("trial.retries", -1, "'trial.retries'"),
    ("max_trials", 0, "'max_trials'"),
    ("parallel_trials", 0, "'parallel_trials'"),
    ("durability.lease_duration", 0.1, "lease_duration"),
    ("resources.gpus", [0, 0], "gpus must be unique"),
    ("colour", "blue", "'colour': unknown field"),
    # Upper limits (issue 11): a spec from the REST API cannot ask for a million rows.
    ("max_trials", 1_000_000, "'max_trials': Input should be less than or equal to 100000"),
    ("parallel_trials", 5000, "'parallel_trials': Input should be less than or equal to 1024"),
    ("max_failed_trials", 10**9, "'max_failed_trials': Input should be less than or equal"),
    ("trial.retries", 1000, "'trial.retries': Input should be less than or equal to 100"),
    ("trial.timeout", 1e12, "'trial.timeout': Input should be less than or equal"),
    ("resources.gpus", [10**6], "'resources.gpus.0': Input should be less than or equal"),
    ("durability.poll_interval", 1e9, "'durability.poll_interval': Input should be less"),
    ("parameters.x2", {"type": "categorical", "choices": list(range(20_000))},
     "'parameters.x2.choices': List should have at most 10000 items"),
])
def test_malformed_field_names_it_on_one_line(make_spec: Any, path: str, value: Any,
                                              expected: str) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(_with(make_spec(), path, value))
    message = str(info.value)
    assert expected in message
    assert "\n" not in message
    assert message.startswith("invalid experiment spec")


@pytest.mark.parametrize("name", ["random", "tpe", "cmaes", "qmc", "gp"])
def test_every_algorithm_builds_and_samples(make_spec: Any, name: str) -> None:
    spec = make_spec()
    spec["algorithm"] = {"name": name, "seed": 1}
    assert load_spec(spec).algorithm.name == name  # load_spec runs two trials with it


@pytest.mark.parametrize("early_stopping", [
    {"name": "none"}, {"name": "median", "n_warmup_steps": 2}, {"name": "percentile",
    "percentile": 25.0}, {"name": "asha", "min_resource": 2}, {"name": "hyperband"}])
def test_every_early_stopping_rule_builds(make_spec: Any,
                                          early_stopping: dict[str, Any]) -> None:
    spec = load_spec(make_spec(early_stopping=early_stopping))
    assert spec.early_stopping.name == early_stopping["name"]


def test_missing_required_field(make_spec: Any) -> None:
    spec = make_spec()
    del spec["objective"]
    with pytest.raises(SpecError, match="field 'objective': Field required"):
        load_spec(spec)


def test_grid_needs_steps_and_enough_points(make_spec: Any) -> None:
    with pytest.raises(SpecError, match="'parameters.x1.step'"):
        load_spec(make_spec(algorithm={"name": "grid"}))
    grid = make_spec(algorithm={"name": "grid"}, parameters={
        "x1": {"type": "int", "low": 0, "high": 1},
        "x2": {"type": "categorical", "choices": [1, 2]}}, max_trials=5)
    grid["algorithm"] = {"name": "grid"}
    with pytest.raises(SpecError, match="exceeds the grid size 4"):
        load_spec(grid)


def test_huge_grid_is_refused_without_enumerating_it(make_spec: Any) -> None:
    spec = make_spec(parameters={"x1": {"type": "int", "low": 0, "high": 10**15}})
    spec["algorithm"] = {"name": "grid"}
    with pytest.raises(SpecError, match=r"'parameters.x1': the grid would have more than "
                                        r"1000000 points; got 1000000000000001"):
        load_spec(spec)  # returns at once: list(range(10**15)) would never finish


@pytest.mark.parametrize(("command", "quote"), [
    ("train --act='${x1}'", "single"),
    ('train --act="${x1}"', "double"),
    ("sh -c 'train ${x1} ${x2}'", "single"),
    ('echo "it\'s ${x2}"', "double"),
])
def test_placeholder_inside_quotes_is_refused(make_spec: Any, command: str,
                                              quote: str) -> None:
    """Issue 11: ``'${v}'`` quotes the shell-quoted value again, so a categorical value
    like ``x'; touch pwned; '`` would escape its quoting and run."""
    with pytest.raises(SpecError) as info:
        load_spec(make_spec(trial={"command": command}))
    message = str(info.value)
    assert message.startswith("invalid experiment spec: field 'trial.command': placeholder $")
    assert f"is inside {quote} quotes" in message and "remove the quotes" in message
    assert "\n" not in message


@pytest.mark.parametrize("command", [
    "train --act=${x1} ${x2}",
    "echo \\'${x1} \\\"${x2}",     # escaped quotes are no quotes
    "echo \"$HOME\" '$PATH' ${x1} \"a'b\" ${x2}",  # shell variables in quotes are fine
])
def test_placeholder_outside_quotes_is_accepted(make_spec: Any, command: str) -> None:
    assert load_spec(make_spec(trial={"command": command})).trial.command == command


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read spec file"):
        load_spec(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(bad)
    bad.write_text("- a list")
    with pytest.raises(SpecError, match="must be a mapping"):
        load_spec(bad)


def test_render_command_leaves_shell_variables_alone() -> None:
    assert render_command("echo $HOME ${x} $(pwd)", {"x": "'a b'"}) == "echo $HOME 'a b' $(pwd)"


def test_search_fields_ignore_per_machine_settings(make_spec: Any) -> None:
    a = load_spec(make_spec())
    b = load_spec(make_spec(parallel_trials=7, trial={"workdir": "/tmp"}))
    assert a.search_fields() == b.search_fields()
    assert a.search_fields() != load_spec(make_spec(max_trials=9)).search_fields()
