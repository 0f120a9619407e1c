"""Distributed equivalence: the engine on N ranks must train like the single-process
plain loop of ``tests/equivalence.py`` (same model cases, same batches, same optimizer).

A *scenario* is ``(case name, config fragment)``. Each rank builds the model with the
suite's seed, trains ``STEPS`` global batches through ``engine.local_batch`` and
``engine.train_batch``, and reports its losses and the full ``model_state_dict()``.
Scenarios are run in groups, one spawn per group, because starting ranks (torch,
transformers, gloo rendezvous) costs far more than training these tiny models.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import hybridtrain as ht
from hybridtrain.models.gpt import GPT, GPTConfig
from tests.equivalence import (
    MODES,
    SEED,
    Mode,
    ModelCase,
    assert_same_training,
    engine_config,
    frozen_gpt_case,
    gpt_case,
    model_cases,
    plain_run,
)
from tests.models.hf_families import FAMILIES, family_case
from tests.parallel.spawn import run_ranks

STEPS = 5
RTOL = 1e-4
ATOL = 1e-5
Result = tuple[list[float], dict[str, torch.Tensor]]
Scenario = tuple[str, dict[str, Any]]


class ResidualMLP(nn.Module):
    """``x + mlp(norm(x))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(),
                                 nn.Linear(2 * width, width))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.mlp(hidden)


class InlineTiedLM(nn.Module):
    """A language model whose forward code reuses the embedding as the output head
    (``h @ self.emb.weight.T``) instead of a head module sharing the weight: under a
    pipeline the first and the last stage both use it, which only the code shows."""

    def __init__(self, vocab: int = 64, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(ResidualMLP(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.emb(tokens)
        for block in self.blocks:
            hidden = block(hidden)
        return self.norm(hidden) @ self.emb.weight.T


def cases() -> dict[str, ModelCase]:
    """The suite's model cases plus ``gpt_deep`` (the tied-embedding GPT with 4 blocks and
    4 heads, enough for 4 pipeline stages or 2 ranks × 2 virtual stages and TP of 4) and
    ``inline_tied`` (:class:`InlineTiedLM`), ``gpt_frozen`` (a fine-tune's frozen
    parameters, :func:`tests.equivalence.frozen_gpt_case`), and Hugging Face BERT (its MLM
    bias has two names: ``cls.predictions.bias`` and ``cls.predictions.decoder.bias``)."""
    deep = GPTConfig(n_layer=4, n_head=4, d_model=32, seq_len=16, vocab_size=64)
    return {**model_cases(), "gpt_deep": dataclasses.replace(gpt_case(), name="gpt_deep", build=lambda: GPT(deep)),
            "inline_tied": dataclasses.replace(gpt_case(), name="inline_tied", build=InlineTiedLM),
            "gpt_frozen": frozen_gpt_case(), "hf_bert": family_case(FAMILIES["bert"])}


def train_scenarios(scenarios: dict[str, Scenario], steps: int = STEPS) -> dict[str, Any]:
    """On one rank: train every scenario; returns name → ``(losses, state)`` or topology."""
    known = cases()
    out: dict[str, Any] = {}
    for name, (case_name, config) in scenarios.items():
        case = known[case_name]
        torch.manual_seed(SEED)
        model = case.build()
        batches = case.batches(steps)
        engine = ht.initialize(model, engine_config(Mode(name, config)), loss_fn=case.loss_fn,
                               example_batch=batches[0])
        torch.manual_seed(SEED + 1)
        losses = [engine.train_batch(engine.local_batch(batch)) for batch in batches]
        out[name] = (losses, engine.model_state_dict(), engine.topology.describe())
    return out


class GroupRunner:
    """Runs each scenario group once per test session and remembers results or the error."""

    def __init__(self, groups: dict[str, tuple[int, dict[str, Scenario]]], timeout: float = 150.0) -> None:
        self.groups = groups
        self.timeout = timeout
        self._done: dict[str, list[dict[str, Any]] | BaseException] = {}

    def results(self, group: str) -> list[dict[str, Any]]:
        """Every rank's results for ``group`` (raises the group's failure again)."""
        if group not in self._done:
            world, scenarios = self.groups[group]
            try:
                self._done[group] = run_ranks(train_scenarios, world, scenarios, timeout=self.timeout)
            except BaseException as exc:  # remembered so the group's other tests fail fast
                self._done[group] = exc
        done = self._done[group]
        if isinstance(done, BaseException):
            raise done
        return done

    def find(self, name: str) -> list[Any]:
        """Every rank's ``(losses, state, topology)`` for scenario ``name``."""
        for group, (_, scenarios) in self.groups.items():
            if name in scenarios:
                return [rank[name] for rank in self.results(group)]
        raise KeyError(name)


_REFERENCE: dict[tuple[str, str], Result] = {}


def reference(case_name: str, mode: str = "plain") -> Result:
    """The single-process plain loop for a model case (full batch), cached; ``mode`` names
    its precision settings in ``tests.equivalence.MODES`` (``plain`` = fp32, ``bf16``,
    ``fp16`` with torch's GradScaler)."""
    if (case_name, mode) not in _REFERENCE:
        _REFERENCE[case_name, mode] = plain_run(cases()[case_name], MODES[mode], steps=STEPS)
    return _REFERENCE[case_name, mode]


def assert_equivalent(per_rank: list[Any], case_name: str, rtol: float = RTOL, atol: float = ATOL,
                      check: Callable[[Result, Result], None] | None = None, mode: str = "plain") -> None:
    """Every rank reports the same losses, and rank 0 trained like the plain loop (in the
    precision ``mode``)."""
    losses = [r[0] for r in per_rank]
    assert all(rank_losses == losses[0] for rank_losses in losses), f"ranks disagree on the loss: {losses}"
    expected = reference(case_name, mode)
    actual = (per_rank[0][0], per_rank[0][1])
    (check or (lambda e, a: assert_same_training(e, a, rtol=rtol, atol=atol)))(expected, actual)


def resume_round_trip(case_name: str, config: dict[str, Any], ckpt_dir: str,
                      inspect: Callable[[ht.Engine], dict[str, Any]] | None = None) -> dict[str, Any]:
    """On one rank: 4 steps straight; then 2 steps, save, a fresh engine loads, 2 more.

    Args:
        inspect: called with the interrupted engine right after it saved; its entries are
            added to the result (e.g. a shard-local view of the optimizer state).
    """
    case = cases()[case_name]
    batches = case.batches(4)

    def engine() -> ht.Engine:
        torch.manual_seed(SEED)
        return ht.initialize(case.build(), engine_config(Mode("resume", config)), loss_fn=case.loss_fn,
                             example_batch=batches[0])

    straight = engine()
    expected = [straight.train_batch(straight.local_batch(b)) for b in batches]
    first = engine()
    losses = [first.train_batch(first.local_batch(b)) for b in batches[:2]]
    first.save_checkpoint(f"{ckpt_dir}/ckpt", client_state={"step": 2})
    extra = inspect(first) if inspect else {}
    resumed = engine()
    client = resumed.load_checkpoint(f"{ckpt_dir}/ckpt")
    losses += [resumed.train_batch(resumed.local_batch(b)) for b in batches[2:]]
    return {"expected": expected, "resumed": losses, "client": client,
            "final": resumed.model_state_dict(), "straight": straight.model_state_dict(), **extra}


def assert_resumed_exactly(out: dict[str, Any]) -> None:
    """A :func:`resume_round_trip` result: same losses and parameters as the straight run."""
    assert out["client"] == {"step": 2}
    torch.testing.assert_close(torch.tensor(out["resumed"]), torch.tensor(out["expected"]), rtol=1e-6, atol=0)
    for key, value in out["straight"].items():
        torch.testing.assert_close(out["final"][key], value, rtol=1e-6, atol=1e-7)
