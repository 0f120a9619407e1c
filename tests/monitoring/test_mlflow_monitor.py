"""MLflow tracking against a real ``mlflow server`` (started here on a free loopback port with a
throwaway sqlite store): the config as parameters and as ``config.json``, every metrics.jsonl
value as a metric at its step, the service's job name as run name and tag, a resumed run logging
into the same MLflow run, a job of a real ``hybridtrain serve`` tracked the same way, and
one-line refusals of settings that cannot work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hybridtrain.config import ConfigError, load_config
from hybridtrain.engine import NonFiniteLossError
from hybridtrain.monitoring.mlflow_monitor import RUN_FILE, flat_params, metric_points
from hybridtrain.trainer import run_training
from tests.monitoring.conftest import free_port

mlflow = pytest.importorskip("mlflow", reason="mlflow is not installed (pip install 'hybridtrain[tracking]')")
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def tracking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ``mlflow server`` (one worker, sqlite store, artifacts served by it); its address."""
    if subprocess.run([sys.executable, "-c", "import mlflow.server, flask, sqlalchemy, graphene"],
                      capture_output=True).returncode != 0:
        pytest.skip("the mlflow tracking server is not installed (mlflow-skinny has none; pip install mlflow)")
    root, port = tmp_path_factory.mktemp("mlflow"), free_port()
    env = os.environ | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts")],
        env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=open(root / "server.log", "w"))  # noqa: SIM115
    address = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while not _answers(address):
            assert server.poll() is None, (root / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "mlflow server did not answer in 90 s"
            time.sleep(0.2)
        yield address
    finally:
        server.terminate()
        server.wait(30)


def _answers(address: str) -> bool:
    try:
        with urllib.request.urlopen(address + "/health", timeout=2):
            return True
    except OSError:
        return False


def test_a_run_and_its_resume_reach_the_tracking_server(tracking_server: str, tiny: dict[str, Any],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDTRAIN_JOB_NAME", "job-7")  # as the training service starts a job
    raw = {**tiny, "mlflow": {"enabled": True, "tracking_uri": tracking_server, "experiment": "exp-a",
                              "tags": {"team": "llm"}}}
    run_training(load_config(raw), progress=False)
    out = Path(tiny["train"]["output_dir"])
    client = mlflow.tracking.MlflowClient(tracking_server)
    run_id = json.loads((out / RUN_FILE).read_text())["run_id"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "job-7"
    assert client.get_experiment(run.info.experiment_id).name == "exp-a"
    assert run.data.tags["team"] == "llm" and run.data.tags["hybridtrain.job"] == "job-7"
    config = json.loads((out / "config.json").read_text())
    assert run.data.params["train.steps"] == "6" and run.data.params["model.name"] == '"gpt-tiny"'
    assert run.data.params["scheduler.params.warmup_num_steps"] == "2"
    assert json.loads(Path(client.download_artifacts(run_id, "config.json", str(out))).read_text()) == config
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for field in ("loss", "lr", "tokens_per_s", "eval_loss"):
        expected = [(r["step"], r[field]) for r in rows if field in r]
        logged = [(m.step, m.value) for m in client.get_metric_history(run_id, field)]
        assert sorted(logged) == expected and expected, field
    # Resume to step 8: the same MLflow run, steps 7 and 8 added.
    raw["train"] = {**raw["train"], "steps": 8}
    run_training(load_config(raw), resume=True, progress=False)
    assert json.loads((out / RUN_FILE).read_text())["run_id"] == run_id
    assert client.get_run(run_id).info.status == "FINISHED"
    steps = sorted(m.step for m in client.get_metric_history(run_id, "loss"))
    assert steps[-2:] == [7, 8] and set(steps) == set(range(1, 9))


def test_a_failed_run_is_failed_in_mlflow(tracking_server: str, tiny: dict[str, Any]) -> None:
    raw = {**tiny, "optimizer": {"type": "AdamW", "params": {"lr": 1e30}},  # the loss turns NaN in a few steps
           "mlflow": {"enabled": True, "tracking_uri": tracking_server, "experiment": "exp-failed"}}
    with pytest.raises(NonFiniteLossError, match=r"loss is nan at step \d+") as err:
        run_training(load_config(raw), progress=False)
    failed_at = int(str(err.value).split("at step ")[1].split(";")[0])
    client = mlflow.tracking.MlflowClient(tracking_server)
    [run] = client.search_runs([client.get_experiment_by_name("exp-failed").experiment_id])
    assert run.info.status == "FAILED" and failed_at > 1
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, failed_at))


def test_a_training_service_job_is_tracked(tracking_server: str, tmp_path: Path) -> None:
    """A job of a real ``hybridtrain serve`` whose config has an ``mlflow`` section: its run is
    named after the job and holds the job's metrics."""
    pytest.importorskip("fastapi")
    from tests.service.serving import TOKEN, serving

    config = tmp_path / "job.yaml"
    config.write_text(json.dumps({"device": "cpu", "model": {"name": "gpt-tiny", "overrides": {"n_layer": 1}},
                                  "data": {"seq_len": 16}, "train_batch_size": 4,
                                  "train": {"steps": 3, "eval_every": 3, "eval_batches": 1},
                                  "mlflow": {"enabled": True, "tracking_uri": tracking_server,
                                             "experiment": "service-jobs"}}))
    with serving(tmp_path) as printed:
        base = printed["base"]

        def call(method: str, path: str, body: dict[str, Any] | None = None) -> Any:
            request = urllib.request.Request(base + path, method=method, headers={
                "Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
                data=json.dumps(body).encode() if body is not None else None)
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read())

        call("POST", "/v1/jobs", {"name": "tracked", "config": str(config)})
        deadline = time.monotonic() + 120
        while (state := call("GET", "/v1/jobs/tracked")["state"]) in ("queued", "running"):
            assert time.monotonic() < deadline, "the job did not finish in 120 s"
            time.sleep(0.3)
        assert state == "succeeded", (tmp_path / "jobs" / "tracked" / "output.log").read_text()[-2000:]
    client = mlflow.tracking.MlflowClient(tracking_server)
    [run] = client.search_runs([client.get_experiment_by_name("service-jobs").experiment_id])
    assert run.info.run_name == "tracked" and run.data.tags["hybridtrain.job"] == "tracked"
    assert run.data.params["train.steps"] == "3" and run.info.status == "FINISHED"
    rows = [json.loads(line) for line in (tmp_path / "jobs" / "tracked" / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    for field in ("loss", "eval_loss"):
        logged = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, field))
        assert logged == [(r["step"], r[field]) for r in rows if field in r] and logged, field


def test_settings_that_cannot_work_are_refused_in_one_line(tiny: dict[str, Any],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError) as err:
        load_config({"mlflow": {"tracking_uri": "ftp://host/runs"}})
    assert str(err.value) == ("config mlflow.tracking_uri = 'ftp://host/runs' is not allowed: scheme 'ftp' is not "
                              "one MLflow tracks runs under; give a directory or a URI of http, https, file, sqlite, "
                              "postgresql, mysql, mssql, databricks")
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = load_config({**tiny, "mlflow": {"enabled": True, "tracking_uri": closed}})
    with pytest.raises(ConfigError, match=rf"^mlflow.tracking_uri = '{closed}': it does not answer \(.*\); start"):
        run_training(cfg, progress=False)
    assert not Path(tiny["train"]["output_dir"], "metrics.jsonl").exists()  # refused before any step
    blocker = Path(tiny["train"]["output_dir"]).parent / "a-file"
    blocker.write_text("")
    nowhere = f"sqlite:///{blocker}/mlflow.db"  # a store MLflow cannot open: its directory is a file
    with pytest.raises(ConfigError, match=rf"^mlflow.tracking_uri = '{nowhere}': MLflow cannot use it \(") as err:
        run_training(load_config({**tiny, "mlflow": {"enabled": True, "tracking_uri": nowhere}}), progress=False)
    assert "\n" not in str(err.value) and not Path(tiny["train"]["output_dir"], "metrics.jsonl").exists()
    monkeypatch.setitem(sys.modules, "mlflow", None)  # "not installed", whatever this machine has
    with pytest.raises(ConfigError, match=r"mlflow.enabled is true but the mlflow package is not installed"):
        run_training(cfg, progress=False)


def test_params_and_points_are_what_mlflow_takes() -> None:
    params = dict(flat_params({"a": {"b": 1, "c": {}, "d": [0.9, 0.99]}, "e": None, "f": "x" * 900}))
    assert params == {"a.b": "1", "a.d": "[0.9, 0.99]", "e": "null", "f": '"' + "x" * 499}
    events = [("hybridtrain/loss", 2.5, 3), ("Train/Samples/train_loss", 2.5, 12), ("hybridtrain/lr", 0.1, 3)]
    assert metric_points(events) == [("loss", 2.5, 3), ("lr", 0.1, 3)]
