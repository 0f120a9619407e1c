"""The metric-name contract, the endpoint's rendering, the monitors' files, W&B (with a
stand-in module), resume, and one-line refusals of monitor settings that cannot work."""

from __future__ import annotations

import csv
import json
import math
import socket
import sys
import types
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from hybridtrain.config import ConfigError, load_config
from hybridtrain.monitoring import monitors as mon
from hybridtrain.monitoring.metric_names import COUNTERS, MEMORY_KINDS, METRICS, STEP_PARTS
from hybridtrain.monitoring.prometheus import RECORD_FIELDS, MetricsServer
from hybridtrain.monitoring.readings import device_peak_tflops, flops_per_token
from hybridtrain.monitoring.telemetry import Telemetry, check_monitoring
from hybridtrain.trainer import run_training

CUDA_RECORD: dict[str, Any] = {
    "step": 7, "loss": 2.5, "lr": 3e-4, "loss_scale": 1024.0, "skipped_steps": 2, "tokens_per_s": 1e5,
    "samples_per_s": 50.0, "tflops": 120.5, "mfu": 0.42, "forward_s": 0.1, "backward_s": 0.2,
    "forward_backward_interleaved_s": 0.0, "step_s": 0.05, "transfer_s": 0.01, "communication_s": 0.02,
    "host_optimizer_s": 0.03,
    "data_s": 0.001, "step_time_s": 0.4, "memory_allocated_bytes": 1 << 30, "memory_reserved_bytes": 2 << 30,
    "peak_memory_bytes": 3 << 30, "alloc_retries": 1, "ooms": 0, "pinned_host_bytes": 4096,
    "checkpoint_s": 1.5, "checkpoint_bytes": 12345, "restarts": 3, "eval_loss": 2.7,
    "peak_memory_reserved_bytes": 4 << 30,
    "transfer_bytes": {"activations_out": 10, "activations_in": 10, "weights_up": 20, "gradients_down": 30,
                       "device_map": 0},
}


def test_metric_names_are_the_dashboard_contract() -> None:
    assert len(METRICS) == 19 and all(n.startswith("hybridtrain_") for n in METRICS)
    assert sorted(COUNTERS) == ["hybridtrain_device_alloc_retries_total", "hybridtrain_device_ooms_total",
                                "hybridtrain_restarts_total", "hybridtrain_skipped_steps_total"]
    assert set(STEP_PARTS) == {"forward", "backward", "interleaved", "optimizer", "transfer", "communication",
                               "host_optimizer", "data", "total"}
    assert MEMORY_KINDS == ("allocated", "reserved", "peak", "peak_reserved")
    # Every name has a metrics.jsonl field that feeds it, and nothing else is exposed.
    assert {name for name, _ in RECORD_FIELDS.values()} == set(METRICS)


def _page(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def test_endpoint_renders_every_series_with_rank_and_its_own_registry() -> None:
    server = MetricsServer("127.0.0.1", 0, rank=3)
    try:
        server.update(CUDA_RECORD)
        server.update({"step": 8, "loss": float("nan")})  # NaN: the series is left out, the rest stays
        families = {f.name: f for f in text_string_to_metric_families(_page(server.port))}
    finally:
        server.close()
    exposed = {f"{n}_total" if f.type == "counter" else n for n, f in families.items()}
    assert exposed == set(METRICS) - {"hybridtrain_loss"}
    samples = [s for f in families.values() for s in f.samples]
    assert all(s.labels["rank"] == "3" for s in samples)
    assert not any(s.name.startswith(("python_", "process_")) for s in samples)
    parts = {s.labels["part"]: s.value for s in families["hybridtrain_step_seconds"].samples}
    assert set(parts) == set(STEP_PARTS) and parts["total"] == 0.4
    kinds = {s.labels["kind"]: s.value for s in families["hybridtrain_device_memory_bytes"].samples}
    assert kinds == {"allocated": 1 << 30, "reserved": 2 << 30, "peak": 3 << 30, "peak_reserved": 4 << 30}
    moved = {s.labels["kind"]: s.value for s in families["hybridtrain_transfer_bytes"].samples}
    assert moved == CUDA_RECORD["transfer_bytes"]
    value = {s.name: s.value for s in samples if len(s.labels) == 1}
    assert value["hybridtrain_step"] == 8 and value["hybridtrain_mfu"] == 0.42
    assert value["hybridtrain_skipped_steps_total"] == 2 and value["hybridtrain_restarts_total"] == 3
    assert families["hybridtrain_restarts"].type == "counter"


def test_port_in_use_and_bad_monitor_settings_are_one_line_errors(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=f"train.metrics_port: cannot serve metrics on 127.0.0.1:{port}"):
            Telemetry(load_config({"train": {"metrics_port": port}})).start_server()
    for raw, needle in (({"tensorboard": {"enabled": "sometimes"}}, "tensorboard.enabled"),
                        ({"csv_monitor": {"enabled": True, "output_dir": "x"}}, "csv_monitor.output_dir"),
                        ({"wandb": {"enabled": True, "entity": "me"}}, "wandb.entity"),
                        ({"train": {"metrics_port": 70000}}, "train.metrics_port")):
        with pytest.raises(ConfigError) as err:
            load_config(raw)
        assert needle in str(err.value) and "\n" not in str(err.value)
    blocker = tmp_path / "file"
    blocker.write_text("")
    telemetry = Telemetry(load_config({"csv_monitor": {"enabled": True, "output_path": str(blocker)}}))
    with pytest.raises(ConfigError, match="csv_monitor.output_path: cannot create") as err:
        telemetry.open_monitors(True, 4, 0)
    assert "\n" not in str(err.value)


def test_wandb_without_the_package_is_refused_before_training(monkeypatch: pytest.MonkeyPatch, tiny: dict[str, Any],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # "not installed", whatever this machine has
    cfg = load_config({**tiny, "wandb": {"enabled": True}})
    with pytest.raises(ConfigError, match=r"wandb.enabled is true but the wandb package is not installed"):
        check_monitoring(cfg)
    from hybridtrain.commands.cli import main

    config = Path(tiny["train"]["output_dir"]).with_suffix(".json")
    config.write_text(json.dumps({**tiny, "wandb": {"enabled": True}}))
    assert main(["train", str(config), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: wandb.enabled is true but the wandb package is not installed "
                   "(pip install wandb, or set wandb.enabled: false)"]
    assert not Path(tiny["train"]["output_dir"]).exists()  # nothing was trained


class _FakeWandb(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("wandb")
        self.inits: list[dict[str, Any]] = []
        self.logs: list[tuple[dict[str, float], int | None]] = []
        self.defined: list[tuple[str, str | None]] = []
        self.finished = False

    def init(self, **kwargs: Any) -> Any:
        self.inits.append(kwargs)
        return types.SimpleNamespace(finish=self._finish)

    def _finish(self, exit_code: int | None = None) -> None:
        self.finished = True
        self.exit_code = exit_code

    def log(self, data: dict[str, float], step: int | None = None) -> None:
        self.logs.append((data, step))

    def define_metric(self, name: str, step_metric: str | None = None) -> None:
        self.defined.append((name, step_metric))


def test_wandb_logs_both_names_offline_when_no_server(monkeypatch: pytest.MonkeyPatch, tiny: dict[str, Any]) -> None:
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed.getsockname()[1]}")
    cfg = load_config({**tiny, "train": {**tiny["train"], "steps": 2, "eval_every": 0, "checkpoint_every": 0},
                       "wandb": {"enabled": True, "project": "p", "group": "g", "team": "t"}})
    run_training(cfg, progress=False)
    import os

    assert os.environ["WANDB_MODE"] == "offline"
    assert len(fake.inits) == 1 and fake.finished and fake.exit_code == 0
    init = fake.inits[0]
    assert (init["project"], init["group"], init["entity"]) == ("p", "g", "t")
    assert init["config"]["train"]["steps"] == 2
    assert ("Train/Samples/*", "samples") in fake.defined
    out = Path(tiny["train"]["output_dir"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [(data, step) for data, step in fake.logs if "hybridtrain/loss" in data]
    assert [step for _, step in steps] == [1, 2]
    for (data, step), row in zip(steps, [r for r in rows if "loss" in r], strict=True):
        assert data["hybridtrain/loss"] == data["Train/Samples/train_loss"] == row["loss"]
        assert data["samples"] == 4 * step and data["Train/Samples/lr"] == row["lr"]


def test_resume_counts_restarts_and_trims_csv_rows_it_will_redo(tiny: dict[str, Any]) -> None:
    tiny["csv_monitor"] = {"enabled": True}
    tiny["train"].update(steps=4, eval_every=0, checkpoint_every=2)
    run_training(load_config(tiny), progress=False)
    out = Path(tiny["train"]["output_dir"])
    csv_dir = out / "DeepSpeedJobName"
    # Pretend the run died after step 3: its checkpoint at 2 is the newest to resume from.
    import shutil

    shutil.rmtree(out / "checkpoints" / "step-0000004")
    run_training(load_config(tiny), resume=True, progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r.get("restarts", 0) for r in steps] == [0, 0, 1, 1]
    with open(csv_dir / "hybridtrain_loss.csv", newline="") as fh:
        table = list(csv.reader(fh))
    assert table[0] == ["step", "loss"] and [int(s) for s, _ in table[1:]] == [1, 2, 3, 4]
    assert [float(v) for _, v in table[1:]] == [r["loss"] for r in steps]
    with open(csv_dir / "Train_Samples_train_loss.csv", newline="") as fh:
        assert [int(s) for s, _ in list(csv.reader(fh))[1:]] == [4, 8, 12, 16]


def test_a_failing_monitor_is_dropped_and_training_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def write_events(self, events: Any) -> None:
            raise OSError("disk full")

        def flush(self) -> None: ...

        def close(self) -> None: ...

    seen: list[Any] = []

    class Good(Broken):
        def write_events(self, events: Any) -> None:
            seen.extend(events)

    monitors = mon.MonitorSet([Broken(), Good()])
    monitors.write([("a", 1.0, 1)])
    monitors.write([("a", 2.0, 2)])
    monitors.close()
    assert seen == [("a", 1.0, 1), ("a", 2.0, 2)]
    assert any("Broken.write_events failed (OSError: disk full)" in r.getMessage() for r in caplog.records)


def test_flops_and_device_peaks() -> None:
    model = torch.nn.Linear(10, 10)
    assert flops_per_token(model) == 6 * 110
    assert device_peak_tflops(torch.device("cpu")) is None
    assert device_peak_tflops(torch.device("cpu"), override=100.0) == 100.0
    if torch.cuda.is_available():  # pragma: no cover - GPU machines
        name = torch.cuda.get_device_name()
        if any(k in name for k in ("H100", "H200", "A100")):
            assert device_peak_tflops(torch.device("cuda")) is not None


def test_mfu_is_recorded_against_the_configured_peak(tiny: dict[str, Any]) -> None:
    tiny["train"].update(steps=2, eval_every=0, checkpoint_every=0, peak_tflops=0.5)
    run_training(load_config(tiny), progress=False)
    out = Path(tiny["train"]["output_dir"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    for row in rows:
        assert math.isclose(row["mfu"], row["tflops"] / 0.5)
        assert math.isclose(row["samples_per_s"] * 32, row["tokens_per_s"])


def test_transfer_bytes_reach_metrics_jsonl_and_the_prometheus_series(tiny: dict[str, Any]) -> None:
    """Optimizer offload of the tiny GPT: every gradient down and every weight up once per
    step, by the model's size; the Prometheus snapshot shows the same numbers per kind."""
    from hybridtrain.models.factory import parameter_count
    from hybridtrain.monitoring.prometheus import snapshot_of

    tiny["zero_optimization"] = {"stage": 1, "offload_optimizer": {"device": "cpu"}}
    tiny["train"].update(steps=1, eval_every=0, checkpoint_every=0)
    cfg = load_config(tiny)
    run_training(cfg, progress=False)
    rows = [json.loads(line) for line in (Path(tiny["train"]["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    moved = next(r for r in rows if "loss" in r)["transfer_bytes"]
    # fp32 parameters; the demo data are bytes, so the vocabulary is 256
    size = 4 * parameter_count(cfg.model.name, cfg.model.overrides, 256, cfg.data.seq_len)
    assert moved == {"activations_out": 0, "activations_in": 0, "weights_up": size, "gradients_down": size,
                     "device_map": 0}
    series = snapshot_of({"transfer_bytes": moved})
    assert series[("hybridtrain_transfer_bytes", "gradients_down")] == size
    assert series[("hybridtrain_transfer_bytes", "activations_in")] == 0
