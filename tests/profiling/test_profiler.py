"""Profiles of real steps: parts that add up to the step, files, the CLI and DeepSpeed's
flops_profiler section."""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import pytest
import torch

import hybridtrain as ht
from hybridtrain.commands.cli import main
from hybridtrain.config import load_config
from hybridtrain.models.gpt import GPT, GPTConfig, causal_lm_loss
from hybridtrain.profiling.breakdown import PARTS
from hybridtrain.profiling.profiler import profile_engine
from hybridtrain.profiling.scheduled import ScheduledProfile

TINY = {"model.overrides.n_layer": 2, "model.overrides.n_head": 2, "model.overrides.d_model": 32,
        "data.seq_len": 16, "train_micro_batch_size_per_gpu": 2}


def _engine(**config: object) -> tuple[ht.Engine, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, vocab_size=64))
    engine = ht.initialize(model, {"device": "cpu", "train_micro_batch_size_per_gpu": 2,
                                   "gradient_accumulation_steps": 2, **config}, loss_fn=causal_lm_loss)
    ids = torch.randint(0, 64, (4, 17))
    return engine, (ids[:, :-1], ids[:, 1:])


def test_profile_parts_add_up_to_the_step(tmp_path: Path) -> None:
    engine, batch = _engine(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}})
    # Late in the suite the process holds millions of objects from earlier tests: a full
    # garbage collection landing in a 20 ms step (0.3 s, seen only in whole-suite runs) would
    # be measured, rightly, as idle. Those objects are moved out of the collector's way.
    gc.collect()
    gc.freeze()
    try:
        start = time.perf_counter()
        profile = profile_engine(engine, batch, steps=3, output_dir=tmp_path)
        wall = time.perf_counter() - start
    finally:
        gc.unfreeze()
    assert engine.global_step == 3 and profile.timed_steps == 2
    assert list(profile.parts) == list(PARTS)
    assert sum(profile.parts.values()) == pytest.approx(profile.step_seconds, rel=1e-9)
    # The measured parts (not the remainder) cover most of the step, and the step is a real
    # share of the wall time the two steps took.
    assert profile.parts["idle"] < 0.5 * profile.step_seconds
    assert 0 < profile.step_seconds < wall
    # Optimizer offload: the gradients' copies and the host optimizer are measured parts.
    assert profile.parts["transfer"] > 0 and profile.parts["host_optimizer"] > 0
    assert profile.flops["backward"] > profile.flops["forward"] > 0
    assert profile.mfu > 0 and profile.peak_source == "measured matmul"
    blocks = [m for m in profile.modules if m.kind == "block"]
    assert len(blocks) == 2 and all(m.forward_seconds > 0 and m.backward_seconds > 0 for m in blocks)
    assert sum(m.forward_seconds + m.backward_seconds for m in profile.modules) < profile.step_seconds
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert saved["parts"] == pytest.approx(profile.parts) and saved["modules"][2]["name"] == "blocks.0"
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"hybridtrain::train_batch", "hybridtrain::forward", "hybridtrain.module::blocks.1"} <= names
    assert (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"
    assert "blocks.0" in profile.table() and "host_optimizer" in profile.table()


def test_wall_clock_breakdown_measures_transfer_and_host_optimizer() -> None:
    engine, batch = _engine(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}},
                            wall_clock_breakdown=True)
    engine.train_batch(batch)
    t = engine.last_timings
    assert t.forward > 0 and t.backward > 0 and t.transfer > 0 and t.host_optimizer > 0
    inside = t.forward + t.backward + t.step + t.transfer + t.host_optimizer + t.communication
    assert inside <= t.total


def test_cli_prints_the_table_and_writes_its_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sets = [arg for key, value in TINY.items() for arg in ("--set", f"{key}={value}")]
    assert main(["profile", *sets, "--steps", "2", "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "forward" in out and "MFU" in out and "blocks.1" in out
    assert {p.name for p in tmp_path.iterdir()} == {"profile.json", "trace.json", "memory.png"}


@pytest.mark.parametrize(("args", "says"), [
    (["--set", "device=cuda:3"], "device = 'cuda:3'"),
    (["--set", "optimizer.type=Nope"], "optimizer"),
    (["--steps", "1"], "at least 2 steps"),
    (["/no/such/config.json"], "/no/such/config.json"),
    (["--set", "bf16.enabled=true", "--set", "precision_math=deepspeed"],
     "precision_math = 'deepspeed' is not available in hybridtrain profile"),
])
def test_bad_input_is_one_line(args: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    if args[1:] == ["device=cuda:3"] and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["profile", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and says in err and "\n" not in err


def test_deepspeed_flops_profiler_profiles_at_profile_step(tmp_path: Path) -> None:
    cfg = load_config({"flops_profiler": {"enabled": True, "profile_step": 1, "module_depth": -1, "top_modules": 1,
                                          "detailed": True, "output_file": str(tmp_path / "profile.log")}})
    engine, batch = _engine()
    plain, _ = _engine()
    hook = ScheduledProfile(cfg)
    losses = [hook.train_batch(engine, batch) for _ in range(4)]
    # Profiled steps train as the others do: same losses as an unprofiled run.
    assert losses == pytest.approx([plain.train_batch(batch) for _ in range(4)], rel=1e-6)
    assert hook.profile is not None and hook.profile.timed_steps == 1
    assert "blocks.0" in (tmp_path / "profile.log").read_text()
    assert (tmp_path / "profile.json").exists() and (tmp_path / "trace.json").exists()


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: device work the host step can hide behind."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        return grad


class _SlowFirst(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlowBackward.apply(x)


@pytest.mark.parametrize(("clipping", "hidden_at_least", "hidden_at_most"), [(0.0, 0.5, 1.0), (1.0, 0.0, 0.5)])
def test_profile_says_how_much_of_the_host_step_was_hidden(clipping: float, hidden_at_least: float,
                                                            hidden_at_most: float) -> None:
    """Backward reaches the slow first layer last: each later layer's bucket is updated on the
    host (the eager step) while it sleeps. Clipping needs the global norm first, so the
    updates run after backward: only the gradients' norms, which the worker takes as the
    buckets land, hide. They are one read of each gradient against Adam's several passes, so
    well under half the work hides (about a tenth on a 2-core box)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_SlowFirst(), *[torch.nn.Linear(1024, 1024) for _ in range(4)])
    engine = ht.initialize(model, {"device": "cpu", "train_micro_batch_size_per_gpu": 8,
                                   "gradient_clipping": clipping,
                                   "zero_optimization": {"stage": 2, "reduce_bucket_size": 1_100_000,
                                                         "offload_optimizer": {"device": "cpu"}}},
                           loss_fn=lambda out, batch: out.pow(2).mean())
    batch = torch.randn(8, 1024, requires_grad=True)
    profile = profile_engine(engine, batch, steps=3)
    assert profile.host_step_seconds > 0
    assert hidden_at_least <= profile.host_step_hidden <= hidden_at_most, profile.table()
    assert "host optimizer step:" in profile.table()
    # The copies on their streams, as the offload benchmark's timeline measures them.
    assert profile.stream_parts is not None and profile.stream_parts["downloads"] > 0
    assert "on their streams: downloads" in profile.table()


class _SlowForward(torch.nn.Module):
    """Sleeps in forward: device work a background host update can hide behind."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.03)
        return x


def test_with_overlapped_updates_the_clipped_host_step_hides_behind_the_next_forward() -> None:
    """Clipping makes the streamed blocks' host updates wait for every gradient; with
    ``overlap_updates`` they run while the next forward (slow here) goes through the blocks,
    so the profile finds most of the host step hidden. (Without it, only the clipping norms
    the worker takes as blocks land hide behind backward: 3-43 % measured on CPU.)"""
    torch.manual_seed(0)
    # The first block's update is exposed by design (its forward needs it): with 8 blocks at most 1/8,
    # which leaves room for a worker descheduled under load.
    blocks = [torch.nn.Sequential(_SlowForward(), torch.nn.Linear(1024, 1024)) for _ in range(8)]
    model = torch.nn.Sequential(*blocks)
    engine = ht.initialize(model, {"device": "cpu", "train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
                                   "layer_streaming": {"enabled": True}},
                           loss_fn=lambda out, batch: out.pow(2).mean())
    assert not engine.overlap_updates
    batch = torch.randn(8, 1024)
    waited = profile_engine(engine, batch, steps=3)
    engine.overlap_updates = True
    overlapped = profile_engine(engine, batch, steps=4)
    assert overlapped.host_step_seconds > 0 and "overlapped_updates" in overlapped.techniques
    # What hides without overlap (the norms, the gradients' landing) varies with the worker's
    # timing; overlap hides most of the step and clearly more.
    assert overlapped.host_step_hidden >= max(0.5, waited.host_step_hidden + 0.3), (waited.table(), overlapped.table())


def test_layer_major_profile_counts_and_times_the_worker_threads_forwards() -> None:
    """Under layer-major the forwards run in worker threads that torch.profiler does not
    record: FLOPs and MFU count them (as the same step without streaming), and each module's
    forward and backward seconds are measured beside the profiler."""
    plain, batch = _engine()
    engine, _ = _engine(layer_streaming={"enabled": True, "layer_major": True, "boundary_activations": "device"})
    expected = profile_engine(plain, batch, steps=2)
    profile = profile_engine(engine, batch, steps=2)
    assert "layer_major" in profile.techniques and not profile.notes
    assert profile.flops == expected.flops and profile.flops["forward"] > 0
    assert profile.mfu == pytest.approx(profile.flops["total"] / profile.step_seconds / (profile.peak_tflops * 1e12))
    assert [(m.name, m.forward_flops, m.backward_flops) for m in profile.modules] == [
        (m.name, m.forward_flops, m.backward_flops) for m in expected.modules]
    blocks = [m for m in profile.modules if m.kind == "block"]
    assert len(blocks) == 2 and all(m.forward_seconds > 0 and m.backward_seconds > 0 for m in blocks)
    head = next(m for m in profile.modules if m.name == "head")
    assert head.forward_seconds > 0 and head.backward_seconds > 0
    assert sum(m.forward_seconds + m.backward_seconds for m in profile.modules) < profile.step_seconds
