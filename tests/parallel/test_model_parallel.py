"""device_map: naive model parallel inside one process, same math as the plain loop."""

from __future__ import annotations

import pytest
import torch

import hybridtrain as ht
from hybridtrain.models.gpt import GPT, GPTConfig
from tests.equivalence import MODES, assert_same_training, engine_run, model_cases, plain_run

CASES = model_cases()


def _all_blocks_on(device: str, n: int = 3, prefix: str = "blocks") -> dict[str, str]:
    return {f"{prefix}.{i}": device for i in range(n)}


@pytest.mark.parametrize(("case", "device_map"), [
    ("gpt_tied", _all_blocks_on("cpu")),
    ("hf_llama", {"model.layers.0": "cpu", "model.layers.1": "cpu", "lm_head": "cpu"}),
])
def test_device_map_on_cpu_matches_plain_loop(case: str, device_map: dict[str, str]) -> None:
    if case.startswith("hf_"):
        pytest.importorskip("transformers")
    mode = MODES["accum2"]
    expected = plain_run(CASES[case], mode)
    actual = engine_run(CASES[case], mode, device_map=device_map)
    assert_same_training(expected, actual, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
def test_device_map_splits_blocks_between_cpu_and_cuda() -> None:
    mode = MODES["plain"]
    expected = plain_run(CASES["gpt_tied"], mode)
    actual = engine_run(CASES["gpt_tied"], mode, device_map={"blocks.0": "cuda", "blocks.2": "cuda"})
    assert_same_training(expected, actual, rtol=1e-4, atol=1e-5)


def test_hooks_move_activations_to_the_module_device() -> None:
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8, vocab_size=32))
    seen: list[torch.device] = []
    model.blocks[1].register_forward_pre_hook(lambda _, args: seen.append(args[0].device))
    engine = ht.initialize(model, {"device": "cpu", "device_map": {"blocks.1": "cpu"}})
    engine(torch.zeros(2, 8, dtype=torch.long))
    assert seen == [torch.device("cpu")]


@pytest.mark.parametrize(("device_map", "needle"), [
    ({"blocks.9": "cpu"}, "'blocks.9' is not a module of GPT"),
    ({"blocks.0": "tpu:7"}, "is not a device"),
    ({"blocks": "cpu", "blocks.0": "cpu"}, "lies inside 'blocks'"),
    ({"blocks.0": "cuda:63"}, "CUDA device(s)"),
])
def test_bad_device_map_is_one_line_error(device_map: dict[str, str], needle: str) -> None:
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8, vocab_size=32))
    with pytest.raises(ht.ConfigError) as err:
        ht.initialize(model, {"device": "cpu", "device_map": device_map})
    assert needle in str(err.value) and "\n" not in str(err.value)
