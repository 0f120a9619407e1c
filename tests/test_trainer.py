"""The CLI's training loop in-process: Hugging Face models and DeepSpeed configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridtrain.config import load_config
from hybridtrain.trainer import latest_checkpoint, run_training

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_hf_llama_example_trains(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    cfg = load_config(EXAMPLES / "hf_llama.yaml", [f"train.output_dir={tmp_path}", "train.steps=3",
                                                   "data.seq_len=32", "train.eval_batches=1"])
    summary = run_training(cfg, progress=False)
    assert summary.steps == 3 and summary.last_loss is not None and summary.eval_loss is not None
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-0000003"


def test_deepspeed_config_trains_the_reference_gpt(tmp_path: Path) -> None:
    cfg = load_config(EXAMPLES / "ds_config.json", [f"train.output_dir={tmp_path}", "train.steps=3",
                                                    "data.seq_len=32", "train.eval_batches=1"])
    summary = run_training(cfg, progress=False)
    assert summary.steps == 3 and summary.skipped_steps == 0
    assert summary.last_loss is not None and summary.last_loss < summary.first_loss  # type: ignore[operator]


def test_token_vocabulary_must_fit_the_model(tmp_path: Path) -> None:
    import torch

    torch.save(torch.arange(2000) % 600, tmp_path / "tokens.pt")
    cfg = load_config({"data": {"path": str(tmp_path / "tokens.pt"), "seq_len": 16},
                       "model": {"overrides": {"vocab_size": 256}}, "train": {"output_dir": str(tmp_path)}})
    with pytest.raises(ValueError, match="data tokens go up to 599"):
        run_training(cfg, progress=False)


def test_a_model_too_big_for_host_memory_is_refused_before_it_is_built(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import hybridtrain.training_inputs as training_inputs

    monkeypatch.setattr(training_inputs, "available_host_bytes", lambda: 2**30)  # 1 GiB
    cfg = load_config({"device": "cpu", "model": {"name": "gpt-tiny", "overrides": {"n_layer": 100000}},
                       "train": {"steps": 1, "output_dir": str(tmp_path)}})
    with pytest.raises(ValueError, match=r"5\.00 B parameters: 74\.5 GiB of fp32 weights, gradients and Adam "
                                         r"moments, more than the 1\.0 GiB of host memory available"):
        run_training(cfg, progress=False)


@pytest.mark.parametrize(("world", "given", "previous", "expected"), [
    # The run trained 16 samples a step on 2 replicas (micro 2 × accumulation 4); restarted
    # on one process it accumulates 8 micro-batches: the same global batch, the same math.
    ("1", {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 16, (16, 2, 8)),
    ("2", {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 16, (16, 2, 4)),
    # The config's own train_batch_size wins; without a micro-batch size the micro-batch changes.
    ("1", {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}, 16, (8, 2, 4)),
    ("1", {"train_batch_size": 8}, None, (8, None, None)),
    ("1", {"train_micro_batch_size_per_gpu": 2}, None, (None, 2, None)),
])
def test_a_resume_on_another_world_size_keeps_the_global_batch(world: str, given: dict, previous: int | None,
                                                                expected: tuple,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridtrain.trainer import _same_global_batch

    monkeypatch.setenv("WORLD_SIZE", world)
    cfg = _same_global_batch(load_config(given), previous)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expected
    load_config(cfg)  # still a valid config


def test_a_step_of_many_micro_batches_shows_them_in_the_progress_bar(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # 8 micro-batches per optimizer step: the bar says how far the step is (at most twice a
    # second: the first micro-batch shows at once), not only when it ends.
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    cfg = load_config({"device": "cpu", "model": {"overrides": {"n_layer": 1}}, "data": {"seq_len": 16},
                       "train_batch_size": 8, "train_micro_batch_size_per_gpu": 1,
                       "train": {"steps": 2, "output_dir": str(tmp_path), "eval_batches": 1}})
    run_training(cfg, progress=True)
    shown = terminal.getvalue()
    assert "micro=1/8" in shown and "loss=" in shown, shown[-2000:]


def test_deepspeed_precision_math_is_refused_by_the_trainer_in_one_line(tmp_path: Path) -> None:
    from hybridtrain.config import ConfigError
    from tests.tiny_run import tiny_config

    cfg = tiny_config(tmp_path).model_copy(update={"precision_math": "deepspeed"})
    cfg = cfg.model_copy(update={"bf16": cfg.bf16.model_copy(update={"enabled": True})})
    with pytest.raises(ConfigError, match=r"^precision_math = 'deepspeed' is not available in hybridtrain train, "):
        run_training(cfg, progress=False)
    assert latest_checkpoint(tmp_path) is None and not (tmp_path / "metrics.jsonl").exists()  # nothing trained
