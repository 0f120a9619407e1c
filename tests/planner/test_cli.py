"""``hybridtrain estimate`` and ``hybridtrain plan``: output, the written plan trains, and
bad input is one line with the numbers before anything is traced or allocated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hybridtrain.commands.cli import main
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
    (["plan", "{config}", "--device", "H100", "--set", "bf16.enabled=true", "--set", "precision_math=deepspeed"],
     "error: precision_math = 'deepspeed': the planner models bf16/fp16 as autocast over fp32 weights; allowed: "),
    (["estimate", "{config}", "--device", "H100", "--set", "fp16.enabled=true", "--set", "precision_math=deepspeed"],
     "error: precision_math = 'deepspeed': the planner models"),
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


def _keys(tree: object, prefix: str = "") -> set[str]:
    """Dotted paths of every leaf of a JSON-like tree."""
    if not isinstance(tree, dict) or not tree:
        return {prefix} if prefix else set()
    return {k for key, value in tree.items()
            for k in _keys(value, f"{prefix}{key}" if not prefix else f"{prefix}.{key}")}


def _corpus_half_precision() -> list[Path]:
    """The corpus's fp16/bf16 configs at ZeRO stage 0 with an Adam-family optimizer section: where
    DeepSpeed's fp16 wrapper takes the fp16 init step, where plan -o used to write fp16_init_step, and
    which the planner may move to ZeRO (DeepSpeed's LAMB and 1-bit optimizers refuse ZeRO)."""
    corpus = Path(__file__).resolve().parents[1] / "config" / "deepspeed_corpus"
    chosen = []
    for path in sorted(corpus.glob("*.json")):
        raw = json.loads(path.read_text())
        zero = raw.get("zero_optimization")
        stage = zero.get("stage", 0) if isinstance(zero, dict) else int(bool(zero))
        half = any((raw.get(k) or {}).get("enabled") is True for k in ("fp16", "bf16"))
        optimizer = raw.get("optimizer")
        adam = isinstance(optimizer, dict) and str(optimizer.get("type", "")).lower() in ("adam", "adamw")
        if half and stage == 0 and adam:
            chosen.append(path)
    return chosen


def test_plan_on_public_deepspeed_configs_writes_only_their_keys_and_ours(tmp_path: Path) -> None:
    # Real fp16/bf16 DeepSpeed configs at stage 0, planned for 2 processes on a small device: the
    # planner may move them to ZeRO 1-3. The written plan holds the user's keys and the schema's,
    # never DeepSpeed's fp16 init step (the drop-in's rule, decided from the file it loads).
    import contextlib
    import io

    from hybridtrain.config import Config
    from hybridtrain.config.deepspeed_keys import in_schema

    ours = _keys(Config().model_dump(mode="json"))
    files = _corpus_half_precision()
    assert len(files) >= 10
    moved = 0
    for path in files:
        raw = json.loads(path.read_text())
        # The batch sizes of one small run (the files' are for many GPUs), as the corpus report does.
        given = {**{k: v for k, v in raw.items() if k != "gradient_accumulation_steps"}, **TINY,
                 "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}
        source, out = tmp_path / path.name, tmp_path / f"{path.stem}.yaml"
        source.write_text(json.dumps(given))
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            code = main(["plan", str(source), "--device-memory", "8MiB", "--world-size", "2", "-o", str(out)])
        if code == 2:  # refused in one line (a DeepSpeed feature hybridtrain lacks); nothing written
            assert not out.exists()
            continue
        assert code == 0, path.name
        written = yaml.safe_load(out.read_text())
        foreign = {k for k in _keys(written) - _keys(given) - ours if not in_schema(k)}
        assert not foreign, (path.name, foreign)
        assert "fp16_init_step" not in out.read_text()
        moved += (written.get("zero_optimization") or {}).get("stage", 0) > 0
    assert moved, "no plan left ZeRO stage 0: the case this test is for did not happen"


def test_a_plan_that_leaves_stage_0_writes_no_fp16_init_step(tmp_path: Path) -> None:
    # A DeepSpeed file at ZeRO stage 0 with fp16; a plan that moves it to stage 1. hybridtrain's
    # own road takes no fp16 init step at either stage (that is the DeepSpeed drop-in's rule),
    # so the written file is the plan's config, key for key, and loads back to the same math.
    from hybridtrain.commands.plan import write_config
    from hybridtrain.plan.resolve import optimizer_settings

    for given in ({**TINY, "fp16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
                  {**TINY, "fp16": {"enabled": True}}):
        config = load_config(given)
        assert "fp16_init_step" not in config.optimizer.params
        moved = config.model_copy(update={"zero_optimization": load_config(
            {**TINY, "zero_optimization": {"stage": 1}}).zero_optimization})
        write_config(moved, tmp_path / "plan.yaml")
        text = (tmp_path / "plan.yaml").read_text()
        assert "fp16_init_step" not in text
        again = load_config(str(tmp_path / "plan.yaml"))
        assert again == moved
        assert optimizer_settings(again) == optimizer_settings(config)
        assert not optimizer_settings(again).fp16_init_step


def test_plan_states_its_kernel_efficiency_the_modes_it_searches_and_what_binds(
        config: str, capsys: pytest.CaptureFixture[str]) -> None:
    from hybridtrain.hardware.efficiency import H100_MEASURED

    assert main(["plan", config, "--device", "H100", "--host-memory", "128GiB", "--host-bandwidth", "152GB/s"]) == 0
    out = capsys.readouterr().out
    assert f"device compute: {H100_MEASURED.share:.3g} of H100 SXM's dense float32 peak" in out
    assert H100_MEASURED.source in out
    assert "modes searched (each implemented by the runtime):" in out and "Twin-Flow ratio" in out
    binds = next(line.strip() for line in out.splitlines() if line.strip().startswith("binds: "))
    assert "of the" in binds and "x its binding resource" in binds


def test_a_plan_that_fits_nowhere_says_which_memory_binds_by_how_much(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "offload.yaml"
    path.write_text(yaml.safe_dump({**TINY, "bf16": {"enabled": True}}))
    # On a CPU the device peak counts host bytes too: no variant fits 2 MiB, whatever it offloads.
    assert main(["plan", str(path), "--device-memory", "2MiB", "--host-memory", "1KiB"]) == 1
    printed = capsys.readouterr()
    assert printed.err.startswith("error: no plan fits: ") and len(printed.err.strip().splitlines()) == 1
    out = printed.out
    assert "device memory binds: of the variants that fit the host memory, the least needs" in out
    assert "has 1.80 MiB: over by" in out  # 2 MiB less the 10 % margin
    assert "host memory: no variant fits the device memory either" in out
    assert "modes searched" in out


def test_estimate_states_the_kernel_efficiency_of_a_gpu_target(config: str, capsys: pytest.CaptureFixture[str]) -> None:
    from hybridtrain.hardware.efficiency import MEGATRON_A100

    assert main(["estimate", config, "--device", "A100"]) == 0
    out = capsys.readouterr().out
    assert f"device compute: {MEGATRON_A100.share:.3g} of A100 80GB's dense float32 peak" in out
    assert MEGATRON_A100.source in out
