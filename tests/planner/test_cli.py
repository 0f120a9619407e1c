"""``hybridtrain estimate`` and ``hybridtrain plan``: output, the written plan trains, and
bad input is one line with the numbers before anything is traced or allocated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hybridtrain.cli import main
from hybridtrain.config import load_config

TINY = {"model": {"name": "gpt-tiny"}, "data": {"seq_len": 64}, "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 4, "device": "cpu"}


@pytest.fixture
def config(tmp_path: Path) -> str:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return str(path)


def test_estimate_json_has_the_promised_keys(config: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", config, "--device", "H100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device_peak_bytes"] > 0 and out["host_bytes"] == 0 and out["step_seconds"] > 0
    assert set(out["device"]) >= {"parameters", "gradients", "optimizer_state", "activations", "transfer_buffers",
                                  "workspace"}
    assert out["fits"] and out["target"]["name"] == "H100 SXM"


def test_plan_writes_a_config_that_loads_and_trains(config: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.yaml"
    assert main(["plan", config, "--device-memory", "3MiB", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "1. " in printed and "why:" in printed and f"wrote {out}" in printed
    chosen = load_config(str(out))
    assert chosen.train_batch_size == 4 and not chosen.auto
    assert main(["train", str(out), "--steps", "1", "--output-dir", str(tmp_path / "run"), "--no-progress"]) == 0
    assert "loss=" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "expected"), [
    (["plan", "{config}", "--device-memory", "100KiB"], "error: no plan fits: "),
    (["plan", "{config}", "--device", "H100", "--host-memory", "12XB"], "error: --host-memory: '12XB' is not a byte"),
    (["estimate", "{config}", "--device", "Z9000"], "error: --device 'Z9000' is unknown; known: cpu, H100 NVL"),
    (["plan", "{config}"], "error: plan needs the device memory to fit"),
    (["estimate", "{config}", "--device", "H100", "--host-bandwidth", "fast"],
     "error: --host-bandwidth: 'fast' is not a bandwidth; use a positive number of bytes per second"),
    (["plan", "{config}", "--device", "H100", "--host-bandwidth", "0GB/s"],
     "error: --host-bandwidth: '0GB/s' is not a positive bandwidth"),
])
def test_bad_input_is_one_line(argv: list[str], expected: str, config: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main([a.replace("{config}", config) for a in argv]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(expected), err


def test_host_bandwidth_sets_the_host_step_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "offload.yaml"
    path.write_text(yaml.safe_dump({**TINY, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}))
    steps = {}
    for rate in ("25GB", "150GB"):
        assert main(["estimate", str(path), "--device", "H100", "--host-bandwidth", rate, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["target"]["host_bandwidth"] == float(rate.removesuffix("GB")) * 1e9
        steps[rate] = out["time"]["host_step"]
    assert steps["25GB"] == pytest.approx(6 * steps["150GB"])


def test_limit_too_small_names_what_it_needs_and_has(config: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", config, "--device-memory", "100KiB"]) == 1
    err = capsys.readouterr().err
    assert "needs" in err and "has 100.00 KiB" in err


def test_estimate_says_when_the_offloaded_state_does_not_fit_the_host(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "offload.yaml"
    path.write_text(yaml.safe_dump({**TINY, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}))
    assert main(["estimate", str(path), "--device", "A100", "--host-memory", "1MiB"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith("does not fit: host memory: needs ") and "has 1.00 MiB" in err[0]


def test_plan_writes_no_deepspeed_only_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A DeepSpeed file at ZeRO stage 0 with fp16: loading it asks for DeepSpeed's fp16-wrapper
    # step (optimizer.params.fp16_init_step). The written plan is the user's config: the DeepSpeed
    # layer's rule stays out of it, and loading the file asks for the step again.
    deepspeed = {**TINY, "fp16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    given, out = tmp_path / "ds_config.json", tmp_path / "plan.yaml"
    given.write_text(json.dumps(deepspeed))
    assert load_config(str(given)).optimizer.params["fp16_init_step"] is True
    # On an H100 the config as it is wins (ZeRO stage 0). A plan that moves to stage 1 keeps the
    # key: it is no longer DeepSpeed's stage-0 rule there but the same math as the config given.
    assert main(["plan", str(given), "--device", "H100", "-o", str(out)]) == 0
    assert "fp16_init_step" not in out.read_text()
    assert load_config(str(out)).optimizer.params == {"lr": 1e-3, "fp16_init_step": True}


def test_a_written_config_loads_back_to_the_same_math(tmp_path: Path) -> None:
    # A DeepSpeed file without an optimizer section trains the default optimizer without the
    # fp16-wrapper step; written out, an optimizer section would make loading add it.
    from hybridtrain.plan.resolve import optimizer_settings
    from hybridtrain.planner.cli import write_config

    for given in ({**TINY, "fp16": {"enabled": True}},
                  {**TINY, "fp16": {"enabled": True}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                   "zero_optimization": {"stage": 1}}):
        config = load_config(given)
        if "zero_optimization" in given:  # a plan that moved it to stage 0
            config = config.model_copy(update={"zero_optimization": load_config(TINY).zero_optimization})
        write_config(config, tmp_path / "plan.yaml")
        again = load_config(str(tmp_path / "plan.yaml"))
        # The optimizer the plan builds, and whether it takes the zero-gradient step, are the same.
        assert optimizer_settings(again) == optimizer_settings(config)
        assert again.model_copy(update={"optimizer": config.optimizer}) == config
