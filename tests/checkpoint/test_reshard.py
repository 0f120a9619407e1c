"""Checkpoints reshard: saved by one layout, loaded by another, training continues exactly
as the uninterrupted plain loop (the bar of issue 12: 1 → 2, 2 → 1 and 4 → 2 ranks,
ZeRO-3 → DDP, tensor parallel 2 → one process; also 1 → tensor parallel 2, pipeline 2 →
one process, ZeRO-3 × tensor parallel 2 on 4 ranks → one process).

Two spawns cover every case: 4 ranks save ZeRO-3 and ZeRO-3 × TP checkpoints; 2 ranks load
one and the one-process checkpoint, and save ZeRO-3 (in the background), tensor- and
pipeline-parallel ones, which this process loads again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import hybridtrain as ht
from hybridtrain import checkpoint as ckpt
from hybridtrain.checkpoint.export import model_state
from tests.equivalence import MODES, SEED, Mode, engine_config, gpt_case, plain_run
from tests.parallel.spawn import run_ranks

BEFORE, AFTER = 2, 2
RTOL, ATOL = 1e-4, 1e-5
LAYOUTS: dict[str, dict[str, Any]] = {
    "one": {}, "ddp": {},
    "zero2": {"zero_optimization": {"stage": 2}},
    "zero3": {"zero_optimization": {"stage": 3}},
    "tp2": {"tensor_parallel": {"size": 2}},
    "zero3_tp2": {"zero_optimization": {"stage": 3}, "tensor_parallel": {"size": 2}},
    "pp2": {"pipeline": {"stages": 2, "schedule": "1f1b", "micro_batches": 2, "partition": "params"}},
}
Result = tuple[dict[str, Any], list[float], dict[str, torch.Tensor]]


def _engine(layout: str) -> tuple[ht.Engine, list[Any]]:
    case = gpt_case()
    batches = case.batches(BEFORE + AFTER)
    torch.manual_seed(SEED)
    engine = ht.initialize(case.build(), engine_config(Mode(layout, LAYOUTS[layout])), loss_fn=case.loss_fn,
                           example_batch=batches[0])
    return engine, batches


def train_and_save(layout: str, path: str, async_save: bool = False) -> list[float]:
    """Train the first steps on ``layout`` and save (in the background: then train on
    while it is written, as a run would)."""
    engine, batches = _engine(layout)
    torch.manual_seed(SEED + 1)
    losses = [engine.train_batch(engine.local_batch(b)) for b in batches[:BEFORE]]
    engine.save_checkpoint(path, client_state={"data_step": BEFORE}, async_save=async_save)
    if async_save:
        engine.train_batch(engine.local_batch(batches[BEFORE]))
        assert ckpt.wait_for_pending() == Path(path)
    return losses


def load_and_train(layout: str, path: str) -> Result:
    """Load ``path`` onto ``layout`` and train the remaining steps."""
    engine, batches = _engine(layout)
    client = engine.load_checkpoint(path)
    assert engine.global_step == BEFORE
    losses = [engine.train_batch(engine.local_batch(b)) for b in batches[BEFORE:]]
    return client, losses, engine.model_state_dict()


def _four_ranks(tmp: str) -> dict[str, list[float]]:
    return {"zero3x4": train_and_save("zero3", f"{tmp}/zero3x4"),
            "zero3_tp2x4": train_and_save("zero3_tp2", f"{tmp}/zero3_tp2x4")}


def _two_ranks(tmp: str) -> dict[str, Any]:
    return {
        "1->2 ddp": load_and_train("ddp", f"{tmp}/one"),
        "1->2 tp2": load_and_train("tp2", f"{tmp}/one"),
        "4->2 zero2": load_and_train("zero2", f"{tmp}/zero3x4"),
        "zero3 save": train_and_save("zero3", f"{tmp}/zero3x2", async_save=True),
        "zero3->ddp": load_and_train("ddp", f"{tmp}/zero3x2"),
        "tp2 save": train_and_save("tp2", f"{tmp}/tp2"),
        "pp2 save": train_and_save("pp2", f"{tmp}/pp2"),
    }


def _assert_continues(result: Result, expected: tuple[list[float], dict[str, torch.Tensor]], what: str) -> None:
    client, losses, state = result
    assert client == {"data_step": BEFORE}, what
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected[0][BEFORE:]), rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{what}: {m}")
    assert state.keys() == expected[1].keys()
    for name, value in expected[1].items():
        torch.testing.assert_close(state[name], value, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{what} {n}: {m}")


def test_checkpoints_reshard_across_world_sizes_and_layouts(tmp_path: Path) -> None:
    expected = plain_run(gpt_case(), MODES["plain"], steps=BEFORE + AFTER)
    head = expected[0][:BEFORE]
    torch.testing.assert_close(torch.tensor(train_and_save("one", str(tmp_path / "one"))), torch.tensor(head),
                               rtol=1e-5, atol=1e-6)
    four = run_ranks(_four_ranks, 4, str(tmp_path), timeout=240)
    two = run_ranks(_two_ranks, 2, str(tmp_path), timeout=240)
    saved = [*(rank[key] for rank in four for key in rank), *(rank[key] for rank in two
                                                               for key in ("zero3 save", "tp2 save", "pp2 save"))]
    for losses in saved:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(head), rtol=RTOL, atol=ATOL)
    for rank in two:
        for key in ("1->2 ddp", "1->2 tp2", "4->2 zero2", "zero3->ddp"):
            _assert_continues(rank[key], expected, key)
    _assert_continues(load_and_train("one", str(tmp_path / "zero3x2")), expected, "2->1 (zero3)")
    _assert_continues(load_and_train("one", str(tmp_path / "tp2")), expected, "tp2->1")
    _assert_continues(load_and_train("one", str(tmp_path / "pp2")), expected, "pp2->1")
    _assert_continues(load_and_train("one", str(tmp_path / "zero3_tp2x4")), expected, "zero3 x tp2 (4) -> 1")
    # Exported whole from the shards of any layout: the same model as one process's.
    one, _ = model_state(tmp_path / "one")
    for layout in ("zero3x2", "zero3x4", "tp2", "pp2", "zero3_tp2x4"):
        for name, value in model_state(tmp_path / layout)[0].items():
            torch.testing.assert_close(value, one[name], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=f"{layout} {name}": f"{n}: {m}")
