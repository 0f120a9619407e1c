"""A measured step timeline: the same code path on a CPU (wall clock) as on CUDA (timing
events on each stream); the step is settled before and after, and each part is where it ran."""

from __future__ import annotations

import torch

import hybridtrain as ht
from hybridtrain.models.gpt import GPT, causal_lm_loss, gpt_config
from hybridtrain.profiling.timeline import TIMELINE_PARTS, measure_timeline
from hybridtrain.runtime import stream_marks

CFG = gpt_config("tiny", n_layer=2, seq_len=16)


def _engine(extra: dict) -> tuple[object, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    engine = ht.initialize(GPT(CFG), {"device": "cpu", "model": {"blocks": "blocks"},
                                      "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **extra},
                           loss_fn=causal_lm_loss)
    tokens = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1))
    return engine, (tokens[:, :-1], tokens[:, 1:])


def test_optimizer_offload_timeline_has_its_copies_and_host_step() -> None:
    engine, batch = _engine({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    engine.overlap_updates = True  # type: ignore[attr-defined]
    engine.train_batch(batch)  # type: ignore[attr-defined]
    timeline = measure_timeline(engine, batch)
    assert set(timeline) == {*TIMELINE_PARTS, "source"} and timeline["source"] == "wall clock"
    assert timeline["downloads"] > 0 and timeline["uploads"] > 0 and timeline["host_step"] > 0
    assert timeline["recomputation"] == 0.0 and 0 < timeline["compute"] < timeline["total"]


def test_recomputation_is_its_own_part() -> None:
    engine, batch = _engine({"activation_checkpointing": {"enabled": True}})
    timeline = measure_timeline(engine, batch)
    assert timeline["recomputation"] > 0 and timeline["uploads"] == timeline["downloads"] == 0.0


def test_nothing_is_recorded_outside_a_recording() -> None:
    marks = stream_marks.StreamMarks()
    with stream_marks.mark("uploads", None):
        pass
    with marks.recording(), stream_marks.mark("uploads", None), stream_marks.mark("uploads", None):
        pass  # nested: counted once
    assert list(marks.seconds()) == ["uploads"] and len(marks._spans["uploads"]) == 1
