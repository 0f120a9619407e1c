"""CLI smoke tests: help, a short training run, exact resume, signals, bad input."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "gpt_tiny.yaml"


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hybridtrain", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_help_documents_every_option() -> None:
    top = _cli("--help")
    assert top.returncode == 0 and "train" in top.stdout and "hpo" in top.stdout
    train = _cli("train", "--help")
    for option in ("--set", "--resume", "--overwrite", "--output-dir", "--steps", "--data", "--no-progress",
                   "--max-restarts"):
        assert option in train.stdout
    reference = _cli("config", "--reference")
    assert "`gradient_accumulation_steps`" in reference.stdout


def test_train_writes_metrics_checkpoints_and_summary(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env_metrics = tmp_path / "hpo-metrics.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "hybridtrain", "train", str(EXAMPLE), "--steps", "4", "--output-dir", str(out),
         "--set", "steps_per_print=2", "--set", "train.eval_batches=1"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, "HYBRIDTRAIN_METRICS_FILE": str(env_metrics)},
    )
    assert proc.returncode == 0, proc.stderr
    assert "step=2 loss=" in proc.stdout and "step=4 eval_loss=" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("loss=")
    assert "summary: steps 0→4" in proc.stdout
    records = _metrics(out)
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert env_metrics.read_text() == (out / "metrics.jsonl").read_text()
    assert (out / "checkpoints" / "step-0000004" / "meta.json").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["last_loss"] < summary["first_loss"] + 1.0


def test_resume_continues_with_the_uninterrupted_losses(tmp_path: Path) -> None:
    common = [str(EXAMPLE), "--set", "train.checkpoint_every=3", "--set", "train.eval_batches=1", "--no-progress"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert _cli("train", *common, "--steps", "6", "--output-dir", str(full)).returncode == 0
    assert _cli("train", *common, "--steps", "3", "--output-dir", str(part)).returncode == 0
    resumed = _cli("train", *common, "--steps", "6", "--output-dir", str(part), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "continuing from" in resumed.stderr
    losses = lambda out: [r["loss"] for r in _metrics(out) if "loss" in r]  # noqa: E731
    assert losses(part) == losses(full)


def test_sigterm_saves_a_checkpoint_and_resume_finishes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = [sys.executable, "-m", "hybridtrain", "train", str(EXAMPLE), "--steps", "100000", "--output-dir",
            str(out), "--no-progress", "--set", "train.eval_batches=1"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 90
    while time.time() < deadline and not (out / "metrics.jsonl").exists():
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, err
    saved = sorted((out / "checkpoints").glob("step-*"))
    assert saved, err
    step = int(saved[-1].name.split("-")[1])
    # One line about the stop, when it came; how the run ended is in the summary.
    assert [line for line in err.splitlines() if not line.startswith("info:")] == [
        "SIGTERM: stopping after this step and saving a checkpoint (continue with --resume)"], err
    assert f"summary: steps 0→{step} (stopped early; its checkpoint is saved)" in stdout
    resumed = _cli("train", str(EXAMPLE), "--steps", str(step + 2), "--output-dir", str(out), "--resume",
                   "--set", "train.eval_batches=1")
    assert resumed.returncode == 0, resumed.stderr
    assert [r["step"] for r in _metrics(out) if "loss" in r][-3:] == [step, step + 1, step + 2]


@pytest.mark.parametrize(("args", "needle"), [
    (["--set", "gradient_acumulation_steps=2"], "did you mean 'gradient_accumulation_steps'"),
    (["--set", "model.name=gpt-huge"], "model.name 'gpt-huge' is unknown"),
    (["--data", "/nonexistent.txt"], "does not exist"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], needle: str, tmp_path: Path) -> None:
    proc = _cli("train", str(EXAMPLE), "--output-dir", str(tmp_path), *args)
    assert proc.returncode == 2
    assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str]]:
    """``hybridtrain ARGS`` in this process; the exit code and the stderr lines that are not
    info or torch warnings."""
    import logging

    from hybridtrain.commands.cli import main

    logger = logging.getLogger("hybridtrain")
    before = list(logger.handlers)
    try:
        code = main(list(args))
    finally:  # main's info handler writes to this test's captured stderr, closed after it
        for handler in set(logger.handlers) - set(before):
            logger.removeHandler(handler)
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.strip() and not line.startswith(("info:", "  "))
                  and "UserWarning" not in line]


TINY = ["--no-progress", "--set", "device=cpu", "--set", "model.overrides.n_layer=1", "--set", "data.seq_len=16",
        "--set", "train_micro_batch_size_per_gpu=2", "--set", "train.eval_batches=1"]


@pytest.mark.parametrize(("content", "needle"), [
    (b"\xff\xfe train: {}", "is not UTF-8 text (byte 0"),
    (b"", "is empty; write at least one key"),
    (b"# only a comment\n", "is empty; write at least one key"),
    (b"train_batch_size: 1e26", "config train_batch_size = 1e+26 is not allowed"),
    (b"train: {steps: abc}", "config train.steps = 'abc' is not allowed"),
    (None, "is a directory; give the JSON/YAML file inside it"),
])
def test_bad_config_files_are_one_line_naming_the_file(content: bytes | None, needle: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "cfg.yaml"
    if content is None:
        config.mkdir()
    else:
        config.write_bytes(content)
    code, lines = _main(capsys, "train", str(config), "--output-dir", str(tmp_path / "run"))
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert not (tmp_path / "run").exists()  # refused before any work


@pytest.mark.parametrize(("override", "needle"), [
    ("train.steps", "override 'train.steps' must look like section.key=value"),
    ("=3", "override '=3' must look like section.key=value"),
    ("optimizer.params.betas=[0.9", "optimizer.params.betas = '[0.9': must be two numbers"),
    ("train_batch_size=100000000", "need at least"),  # refused from its size, nothing allocated
])
def test_malformed_overrides_are_one_line(override: str, needle: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = _main(capsys, "train", "--output-dir", str(tmp_path), "--set", override)
    assert code == 2 and len(lines) == 1 and needle in lines[0], lines


def test_a_fresh_run_never_clobbers_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "run")
    assert _main(capsys, "train", *TINY, "--steps", "2", "--output-dir", out)[0] == 0
    before = _metrics(tmp_path / "run")
    for launch in ([], ["--nproc-per-node", "2"]):  # the launcher refuses before starting ranks
        code, lines = _main(capsys, "train", *TINY, "--steps", "4", "--output-dir", out, *launch)
        assert code == 2 and lines == [f"error: output directory {out} has checkpoints up to step 2: use --resume "
                                       "to continue or --overwrite to start over"], lines
    assert _metrics(tmp_path / "run") == before
    assert _main(capsys, "train", *TINY, "--steps", "1", "--output-dir", out, "--overwrite")[0] == 0
    assert [r["step"] for r in _metrics(tmp_path / "run") if "loss" in r] == [1]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-0000001"]


@pytest.mark.parametrize(("err", "needle"), [
    (errno.ENOSPC, "disk full writing metrics.jsonl: free space, or point train.output_dir at another disk"),
    (errno.EROFS, "cannot write metrics.jsonl (read-only file system): choose a writable train.output_dir"),
])
def test_write_failures_are_one_line(err: int, needle: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    from hybridtrain.metrics import MetricsLog

    def fail(self: MetricsLog, record: dict) -> None:
        raise OSError(err, os.strerror(err), "metrics.jsonl")

    monkeypatch.setattr(MetricsLog, "write", fail)
    code, lines = _main(capsys, "train", *TINY, "--steps", "1", "--output-dir", str(tmp_path))
    assert code == 1 and lines == [f"error: {needle}"], lines


def test_a_nan_loss_stops_in_one_line_naming_the_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = _main(capsys, "train", *TINY, "--steps", "4", "--output-dir", str(tmp_path),
                        "--set", "optimizer.params.lr=1e20", "--set", "gradient_clipping=0")
    assert code == 1 and len(lines) == 1 and "error: loss is nan at step 2" in lines[0], lines


@pytest.mark.parametrize(("rank", "said"), [(None, ["interrupted: stopped by Ctrl-C"]),
                                            ("0", ["interrupted: stopped by Ctrl-C"]), ("1", [])])
def test_ctrl_c_while_starting_is_one_line_and_exit_130(rank: str | None, said: list[str],
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    # The parser imports torch (seconds): a Ctrl-C then, or in a command that does not
    # catch it, was a traceback. Under torchrun rank 0 says it for the run.
    import hybridtrain.commands.cli

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(hybridtrain.commands.cli, "build_parser", interrupted)
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    code, lines = _main(capsys, "train")
    assert code == 130 and lines == said


# Every option whose value may start with a minus and a digit but is not a plain number
# (argparse's own exception): sizes ("-5GB", refused then in one line naming the option)
# and numbers in scientific notation. The other options take integers, names or paths.
SPACED_VALUES = [
    ("estimate c.yaml --device-memory -5GB", "estimate c.yaml --device-memory=-5GB"),
    ("estimate c.yaml --host-memory -5GB --json", "estimate c.yaml --host-memory=-5GB --json"),
    ("plan c.yaml --device-memory -1e9 --margin -1e-3", "plan c.yaml --device-memory=-1e9 --margin=-1e-3"),
]


@pytest.mark.parametrize(("spaced", "joined"), SPACED_VALUES, ids=[s for s, _ in SPACED_VALUES])
def test_a_value_with_a_leading_minus_parses_after_a_space_as_after_equals(spaced: str, joined: str) -> None:
    from hybridtrain.commands.cli import build_parser

    parser = build_parser()
    assert vars(parser.parse_args(spaced.split())) == vars(parser.parse_args(joined.split()))


def test_a_launched_scripts_own_arguments_stay_its_own() -> None:
    from hybridtrain.commands.cli import build_parser

    args = build_parser().parse_args(["launch", "--nproc-per-node", "2", "train.py", "--lr", "-1e-3", "-5GB", "--x"])
    assert args.script == "train.py" and args.script_args == ["--lr", "-1e-3", "-5GB", "--x"]


def test_the_summary_says_what_each_memory_figure_measures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # On CPU the peak is the process's RSS (hundreds of MiB of torch) while the limit counts
    # live tensor bytes: the summary names both, and prints the peak the limit was checked against.
    import logging

    from hybridtrain.commands.cli import main
    from hybridtrain.commands.train import memory_words
    from hybridtrain.trainer import TrainSummary

    before = list(logging.getLogger("hybridtrain").handlers)
    try:
        assert main(["train", *TINY, "--steps", "2", "--output-dir", str(tmp_path),
                     "--set", "device_memory_limit=40MB"]) == 0
    finally:
        for handler in set(logging.getLogger("hybridtrain").handlers) - set(before):
            logging.getLogger("hybridtrain").removeHandler(handler)
    printed = capsys.readouterr().out
    summary = TrainSummary(**json.loads((tmp_path / "summary.json").read_text()))
    assert f"{memory_words(summary)}, skipped steps 0" in printed, printed
    assert summary.device_memory_limit == 40 * 10**6
    assert summary.peak_tensor_bytes is not None and 0 < summary.peak_tensor_bytes <= 40 * 10**6
    assert summary.peak_memory_bytes > summary.device_memory_limit  # RSS: not what the limit counts
    words = memory_words(summary)
    assert words.startswith("peak memory ") and words.endswith(
        f"GiB (process RSS), device_memory_limit 38.15 MiB counts live tensor bytes: peak "
        f"{summary.peak_tensor_bytes / 2**20:.2f} MiB"), words
    cuda = TrainSummary(**{**summary.__dict__, "device": "cuda:0", "peak_tensor_bytes": None,
                           "peak_memory_bytes": 3 * 2**30, "device_memory_limit": 20 * 2**30})
    assert memory_words(cuda) == "peak memory 3.00 GiB (allocated, device_memory_limit 20.00 GiB)"
    plain = TrainSummary(**{**summary.__dict__, "device_memory_limit": None, "peak_tensor_bytes": None})
    assert memory_words(plain).endswith("GiB (process RSS)")


def test_train_with_deepspeeds_math_resumes_exactly(tmp_path: Path) -> None:
    """``precision_math: deepspeed`` under ``hybridtrain train``: fp16 module weights, fp32 masters and
    DeepSpeed's loss scale (a window of 1 grows it until it overflows, a skip, and shrinks it) are
    checkpointed, so 3 steps and a resume to 6 are the 6 straight steps, every loss, learning rate and
    saved tensor alike."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from hybridtrain.commands.cli import main

    math = ["--set", "fp16.enabled=true", "--set", "fp16.initial_scale_power=16", "--set", "fp16.loss_scale_window=1",
            "--set", "precision_math=deepspeed", "--set", "train.checkpoint_every=3"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(["train", *TINY, *math, "--steps", "6", "--output-dir", str(straight)]) == 0
    assert main(["train", *TINY, *math, "--steps", "3", "--output-dir", str(split)]) == 0
    assert main(["train", *TINY, *math, "--steps", "6", "--output-dir", str(split), "--resume"]) == 0

    def steps(run: Path) -> list[tuple[Any, ...]]:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"], r["lr"]) for r in rows if "loss" in r]

    assert steps(split) == steps(straight) and len(steps(straight)) == 6
    assert json.loads((straight / "summary.json").read_text())["skipped_steps"] >= 1  # the scale overflowed
    saved = {}
    for run in (straight, split):
        dcp_to_torch_save(run / "checkpoints" / "step-0000006", run / "final.pt")
        saved[run] = torch.load(run / "final.pt", weights_only=False)
    tensors = {k for k, v in saved[straight].items() if isinstance(v, torch.Tensor)}
    assert {saved[straight][k].dtype for k in tensors if k.startswith("model.") and k.endswith("weight")} == \
        {torch.float16}
    assert {saved[straight][k].dtype for k in tensors if k.endswith(".master")} == {torch.float32}
    for key in tensors:
        assert torch.equal(saved[split][key], saved[straight][key]), key
