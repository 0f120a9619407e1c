"""Katib Experiments: translation (pure), local end-to-end runs of Katib's own examples,
refusals, and export → import round trips."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from hybridtrain.commands.hpo import main
from hybridtrain.hpo.errors import SpecError
from hybridtrain.hpo.katib import is_katib, katib_to_spec
from hybridtrain.hpo.katib_export import check_katib_document, spec_to_katib
from hybridtrain.hpo.spec import load_spec
from hybridtrain.hpo.trial import build_command

pytestmark = pytest.mark.timeout(120)

EXAMPLES = Path(__file__).parent / "katib_examples"
# example -> (our algorithm, our early stopping) after translation
TRANSLATED = {
    "random": ("random", "none"), "grid": ("grid", "none"), "tpe": ("tpe", "none"),
    "multivariate-tpe": ("tpe", "none"), "cma-es": ("cmaes", "none"),
    "sobol": ("qmc", "none"), "bayesian-optimization": ("gp", "none"),
    "hyperband": ("random", "hyperband"), "median-stop": ("random", "median"),
    "optuna-distribution": ("tpe", "none"),
}
# example -> the Katib field its refusal names
REFUSED = {
    "hyperopt-distribution": "spec.parameters.lr.feasibleSpace.distribution",
    "simple-pbt": "spec.algorithm.algorithmName",
    "median-stop-with-json-format": "spec.metricsCollectorSpec.collector.kind",
}


def katib(name: str, **spec_overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    doc["spec"].update(spec_overrides)
    return doc


def test_every_copied_example_is_covered() -> None:
    assert {p.stem for p in EXAMPLES.glob("*.yaml")} == set(TRANSLATED) | set(REFUSED)
    for path in EXAMPLES.glob("*.yaml"):
        assert path.read_text().startswith("# Source: github.com/kubeflow/katib examples/")


def test_random_translates_field_by_field() -> None:
    spec, notes = katib_to_spec(katib("random"))
    assert spec["name"] == "random"
    # Katib's default strategy of a minimized objective is its minimum over the trial.
    assert spec["objective"] == {"metric": "loss", "direction": "minimize", "goal": 0.001,
                                 "strategy": "min"}
    assert spec["parameters"] == {"lr": {"type": "float", "low": 0.01, "high": 0.05},
                                  "momentum": {"type": "float", "low": 0.5, "high": 0.9}}
    assert spec["algorithm"] == {"name": "random"}
    assert (spec["parallel_trials"], spec["max_trials"], spec["max_failed_trials"]) == (3, 12, 2)
    assert spec["trial"]["command"].startswith("python3 -c ")
    assert spec["trial"]["command"].endswith(
        "--epochs=1 --batch-size=16 --lr=${lr} --momentum=${momentum}")
    assert len(notes) == 1 and "pytorch-mnist-cpu:latest' is ignored" in notes[0]


@pytest.mark.parametrize("name", sorted(TRANSLATED))
def test_example_translates(name: str) -> None:
    notes: list[str] = []
    spec = load_spec(katib(name), notes)
    assert (spec.algorithm.name, spec.early_stopping.name) == TRANSLATED[name]
    assert any("is ignored" in n for n in notes)


def test_settings_map_to_sampler_and_pruner_options() -> None:
    notes: list[str] = []
    cma = load_spec(katib("cma-es"), notes)
    assert cma.algorithm.options == {}
    assert any("restart_strategy=ipop of cmaes has no effect" in n for n in notes)
    assert load_spec(katib("bayesian-optimization")).algorithm.seed == 10
    assert load_spec(katib("multivariate-tpe")).algorithm.options == {"multivariate": True}
    assert load_spec(katib("sobol")).algorithm.options == {"qmc_type": "sobol"}
    hb = load_spec(katib("hyperband"))
    assert hb.early_stopping.options == {"reduction_factor": 2, "min_resource": 1,
                                         "max_resource": 2}
    # The resource parameter gets the full budget r_l; the pruner does the halving.
    assert hb.parameters["num_epochs"].model_dump() == {"type": "categorical", "choices": [2]}
    assert "--epochs=${num_epochs}" in hb.trial.command
    median = load_spec(katib("median-stop"))
    assert median.early_stopping.options == {"n_startup_trials": 1, "n_warmup_steps": 1}
    dist = load_spec(katib("optuna-distribution")).parameters
    assert dist["momentum"].log and dist["batch_size"].log and dist["lr"].step == 0.1


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_example_refused_in_one_line(name: str) -> None:
    with pytest.raises(SpecError) as err:
        load_spec(katib(name))
    assert f"field '{REFUSED[name]}'" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d["spec"]["algorithm"].update(algorithmSettings=[{"name": "gamma",
                                                                  "value": "0.25"}]),
     "field 'spec.algorithm.algorithmSettings.gamma': no hybridtrain equivalent for tpe; "
     "allowed: random_state, n_startup_trials"),
    (lambda d: d["spec"].pop("maxTrialCount"), "field 'spec.maxTrialCount': required"),
    (lambda d: d["spec"].update(parallelTrialCount=True),
     "field 'spec.parallelTrialCount': must be a int"),
    (lambda d: d.update(apiVersion="kubeflow.org/v1alpha3"),
     "field 'apiVersion/kind': only kubeflow.org/v1beta1 Experiment"),
    (lambda d: d["spec"]["trialTemplate"]["trialParameters"].pop(),
     "${trialParameters.momentum} is not a trial parameter; allowed: learningRate"),
    (lambda d: d["spec"]["parameters"][0].update(parameterType="float"),
     "field 'spec.parameters.lr.parameterType': allowed: double, int, categorical, discrete"),
    (lambda d: d["spec"]["parameters"][0]["feasibleSpace"].update(min="small"),
     "field 'spec.parameters.lr.feasibleSpace.min': must be a number; got 'small'"),
    (lambda d: d["spec"].update(earlyStopping={"algorithmName": "medianstop",
                                               "algorithmSettings": [{"name": "x", "value": 1}]}),
     "field 'spec.earlyStopping.algorithmSettings.x': unknown medianstop setting"),
    (lambda d: d["spec"].update(resumeFrom="x"), "field 'spec.resumeFrom': unknown field"),
    (lambda d: d["spec"]["trialTemplate"].update(primaryContainerName="main"),
     "no container of trialSpec has this name; got 'main'"),
])
def test_bad_katib_fields_are_one_line_errors(change: Any, message: str) -> None:
    doc = katib("tpe")
    change(doc)
    with pytest.raises(SpecError) as err:
        load_spec(doc)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_our_specs_are_not_katib(make_spec: Any) -> None:
    assert not is_katib(make_spec()) and is_katib({"kind": "Experiment"})


def test_shell_script_args_env_and_trial_name_run_as_katib_would(tmp_path: Path) -> None:
    """A `sh -c` script with placeholders inside, an env value with one, and
    ${trialSpec.Name}: the rendered command runs and sees the raw values."""
    doc = katib("tpe")
    tt = doc["spec"]["trialTemplate"]
    tt["trialParameters"].append({"name": "trialName", "reference": "${trialSpec.Name}"})
    container = tt["trialSpec"]["spec"]["template"]["spec"]["containers"][0]
    container["command"] = ["sh", "-c"]
    container["args"] = ["echo \"lr=${trialParameters.learningRate} it's ${trialParameters."
                         "trialName}\" m=$MOMENTUM"]
    container["env"] = [{"name": "MOMENTUM", "value": "${trialParameters.momentum}"},
                        {"name": "FIXED", "value": "1"}]
    spec = load_spec(doc)
    assert spec.trial.env == {"FIXED": "1"}
    command = build_command(spec, {"lr": 0.02, "momentum": 0.75}, 7, tmp_path)
    out = subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True,
                         check=True).stdout
    assert out == "lr=0.02 it's tpe-7 m=0.75\n"


@pytest.mark.parametrize("name", ["random", "grid", "tpe", "multivariate-tpe", "cma-es",
                                  "sobol", "hyperband", "median-stop"])
def test_katib_example_runs_locally(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`hpo run` on Katib's own example file (a small maxTrialCount), end to end."""
    trials = 4 if name != "hyperband" else 2
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(katib(name, maxTrialCount=trials)))
    monkeypatch.chdir(tmp_path)  # trial directories go to ./hpo-runs
    assert main(["run", str(path), "--storage", f"sqlite:///{tmp_path / 'hpo.db'}"]) == 0
    out, err = capsys.readouterr()
    status = json.loads(out.strip().splitlines()[-1])
    assert "info: Katib trial: the command of container 'training-container'" in err
    assert status["state"] == "succeeded", status
    counts = status["trials"]
    assert counts["complete"] + counts["pruned"] == trials and counts["failed"] == 0
    assert main(["best", status["name"], "--json", "--storage",
                 f"sqlite:///{tmp_path / 'hpo.db'}"]) == 0
    best = json.loads(capsys.readouterr().out)
    assert 0.1 < best["value"] < 30  # the script's loss: at least 1 / (4 x epochs)


def _roundtrip_spec(make_spec: Any) -> dict[str, Any]:
    return make_spec(
        name="roundtrip",
        objective={"metric": "loss", "direction": "maximize", "goal": 0.9, "strategy": "latest",
                   "additional_metrics": ["acc"]},
        parameters={"x1": {"type": "float", "low": -5.0, "high": 10.0},
                    "x2": {"type": "float", "low": 0.0, "high": 15.0, "step": 0.5},
                    "lr": {"type": "float", "low": 1e-5, "high": 0.1, "log": True},
                    "layers": {"type": "int", "low": 2, "high": 8, "step": 2},
                    "width": {"type": "int", "low": 16, "high": 512, "log": True},
                    "act": {"type": "categorical", "choices": ["gelu", "relu"]},
                    "batch": {"type": "categorical", "choices": [16, 32, 0.5]}},
        algorithm={"name": "tpe", "seed": 3, "n_startup_trials": 4, "multivariate": True},
        early_stopping={"name": "median", "n_startup_trials": 2, "n_warmup_steps": 1},
        trial={"command": "${x1} ${x2} --lr ${lr} --layers ${layers} --width ${width} "
                          "--act ${act} --batch ${batch} --out ${trial_dir}"},
        max_trials=8, max_failed_trials=2)


def test_export_import_round_trips_search_space_and_objective(make_spec: Any) -> None:
    spec = load_spec(_roundtrip_spec(make_spec))
    doc = spec_to_katib(spec, image="registry.example/ht:1")
    check_katib_document(doc)
    container = doc["spec"]["trialTemplate"]["trialSpec"]["spec"]["template"]["spec"][
        "containers"][0]
    assert container["image"] == "registry.example/ht:1"
    assert container["command"][:2] == ["sh", "-c"]
    assert "/runs/roundtrip/${trialParameters.trialName}" in container["command"][2]
    back = load_spec(yaml.safe_load(yaml.safe_dump(doc)))
    assert back.search_fields() == spec.search_fields()
    assert back.parallel_trials == spec.parallel_trials


def test_exported_branin_runs_locally_through_sh_c(make_spec: Any, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`export-katib` → the file `hpo run` accepts, its `sh -c` trial included."""
    monkeypatch.chdir(tmp_path)  # a Katib file has no output_dir: trials go to ./hpo-runs
    spec_file, katib_file = tmp_path / "spec.json", tmp_path / "experiment.yaml"
    spec_file.write_text(json.dumps(make_spec(name="branin-k8s", max_trials=2)))
    assert main(["export-katib", str(spec_file), "-o", str(katib_file)]) == 0
    doc = yaml.safe_load(katib_file.read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("kubeflow.org/v1beta1", "Experiment")
    assert doc["spec"]["trialTemplate"]["trialSpec"]["spec"]["template"]["spec"][
        "containers"][0]["image"] == "hybridtrain:latest"
    check_katib_document(doc)
    capsys.readouterr()
    assert main(["run", str(katib_file), "--storage", f"sqlite:///{tmp_path / 'h.db'}"]) == 0
    status = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert status["trials"]["complete"] == 2


@pytest.mark.parametrize(("overrides", "message"), [
    ({"early_stopping": {"name": "asha"}},
     "field 'early_stopping.name': Katib's early stopping is medianstop only"),
    ({"name": "Branin_Search"}, "field 'metadata.name': Katib needs a DNS-1123 label"),
    ({"algorithm": {"name": "tpe", "constant_liar": False}},
     "field 'algorithm.constant_liar': no Katib setting for tpe"),
])
def test_export_refusals_name_the_field(make_spec: Any, overrides: dict[str, Any],
                                        message: str) -> None:
    spec = load_spec(make_spec(**overrides))
    with pytest.raises(SpecError) as err:
        spec_to_katib(spec)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_export_cli_bad_spec_is_one_line(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\n")
    assert main(["export-katib", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: invalid experiment spec:") and err.count("\n") == 1
