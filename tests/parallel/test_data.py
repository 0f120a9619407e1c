"""DDP: same training as one process on 2 and 4 ranks; compression within its error."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.scenarios import GroupRunner, assert_equivalent, reference

GROUPS = {
    "ddp2": (2, {
        "gpt": ("gpt_tied", {}),
        "gpt_accum": ("gpt_tied", {"gradient_accumulation_steps": 2}),
        "gpt_fp16": ("gpt_tied", {"data_parallel": {"gradient_compression": "fp16"}}),
        "gpt_bf16": ("gpt_tied", {"data_parallel": {"gradient_compression": "bf16"}}),
        "gpt_powersgd": ("gpt_tied", {"data_parallel": {"gradient_compression": "powersgd",
                                                        "powersgd_rank": 2}}),
        "llama": ("hf_llama", {"gradient_accumulation_steps": 2}),
        "frozen": ("gpt_frozen", {"gradient_accumulation_steps": 2}),
    }),
    "ddp4": (4, {"gpt4": ("gpt_tied", {"gradient_accumulation_steps": 2})}),
}
RUNNER = GroupRunner(GROUPS)


@pytest.mark.parametrize(("name", "case"), [("gpt", "gpt_tied"), ("gpt_accum", "gpt_tied"),
                                            ("gpt4", "gpt_tied"), ("llama", "hf_llama"), ("frozen", "gpt_frozen")])
def test_ddp_matches_single_process(name: str, case: str) -> None:
    if case.startswith("hf_"):
        pytest.importorskip("transformers")
    per_rank = RUNNER.find(name)
    assert per_rank[0][2]["dp"] == len(per_rank)
    assert_equivalent(per_rank, case)


@pytest.mark.parametrize(("name", "rtol"), [("gpt_fp16", 1e-3), ("gpt_bf16", 1e-2), ("gpt_powersgd", 2e-2)])
def test_compressed_ddp_stays_within_its_error(name: str, rtol: float) -> None:
    per_rank = RUNNER.find(name)
    losses = torch.tensor(per_rank[0][0])
    expected = torch.tensor(reference("gpt_tied")[0])
    torch.testing.assert_close(losses, expected, rtol=rtol, atol=0.0)
    assert all(r[0] == per_rank[0][0] for r in per_rank), "ranks disagree on the loss"
    # Compression rounds gradients, so the trajectory must differ from exact DDP at all.
    exact = torch.tensor(RUNNER.find("gpt")[0][0])
    assert not torch.equal(losses, exact)
