"""Activation swapping: what travels, how far prefetch runs ahead, which blocks are
wrapped, refusals, what stays after forward (exact live bytes); on CUDA the peak-memory
cut. Equivalence is in the shared suite (``swap*`` and ``cpu_checkpointing*`` modes)."""

from __future__ import annotations

import gc

import pytest
import torch

import hybridtrain as ht
from hybridtrain.config import ConfigError
from hybridtrain.models.gpt import GPT, GPTConfig, causal_lm_loss
from hybridtrain.runtime.activations.swapping import ActivationSwapper, apply_activation_offload
from hybridtrain.runtime.memory_limit import LiveTensorBytes, tensors_alive

CFG = GPTConfig(n_layer=4, n_head=2, d_model=32, seq_len=16, vocab_size=64)


def _train_once(model: GPT, device: str = "cpu") -> None:
    # Drawn on the CPU whatever the device: CUDA's generator draws other numbers from one seed.
    tokens = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1)).to(device)
    causal_lm_loss(model(tokens[:, :-1]), (tokens[:, :-1], tokens[:, 1:])).backward()


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_everything_that_leaves_comes_back_and_prefetch_stays_in_bounds(prefetch: int) -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    swapper = apply_activation_offload(list(model.blocks), torch.device("cpu"), prefetch_blocks=prefetch, min_bytes=0)
    _train_once(model)
    assert swapper.stats.tensors_out > 0
    assert swapper.stats.bytes_in == swapper.stats.bytes_out
    # One entry per block; the first block reached in backward prefetches ``prefetch``
    # earlier blocks, and never more than that are in flight.
    assert len(swapper.stats.prefetch_ahead) == CFG.n_layer
    assert max(swapper.stats.prefetch_ahead) == min(prefetch, CFG.n_layer - 1)


def test_with_checkpointing_only_block_inputs_travel() -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    swapper = apply_activation_offload(list(model.blocks), torch.device("cpu"), recompute=list(model.blocks),
                                       min_bytes=0)
    _train_once(model)
    assert swapper.stats.tensors_out == CFG.n_layer  # the (B, T, C) input of each block
    assert swapper.stats.bytes_out == CFG.n_layer * 4 * CFG.seq_len * CFG.d_model * 4


def test_parameters_and_small_tensors_stay_on_the_device() -> None:
    swapper = ActivationSwapper(torch.device("cpu"), min_bytes=1 << 30)
    lin = torch.nn.Linear(8, 8)
    swapper.wrap(lin)
    lin(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert swapper.stats.tensors_out == 0 and swapper.stats.kept_on_device > 0


def test_config_selects_blocks_and_maps_cpu_checkpointing() -> None:
    model = GPT(CFG)
    ht.initialize(model, {"device": "cpu", "activation_offload": {"enabled": True, "blocks": [1, 3]}},
                  loss_fn=causal_lm_loss)
    wrapped = [hasattr(b, "_hybridtrain_swap_original_forward") for b in model.blocks]
    assert wrapped == [False, True, False, True]
    model = GPT(CFG)
    ht.initialize(model, {"device": "cpu", "activation_checkpointing": {"enabled": True, "every_n_blocks": 2,
                                                                        "cpu_checkpointing": True}},
                  loss_fn=causal_lm_loss)
    assert [hasattr(b, "_hybridtrain_swap_original_forward") for b in model.blocks] == [True, False, True, False]


@pytest.mark.parametrize(("model", "raw", "needle"), [
    (GPT(CFG), {"activation_offload": {"enabled": True, "blocks": [7]}}, "out of range"),
    (torch.nn.Module(), {"activation_offload": {"enabled": True}}, "model.blocks"),
])
def test_bad_settings_are_refused(model: torch.nn.Module, raw: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        ht.initialize(model, {"device": "cpu", **raw}, loss_fn=causal_lm_loss)


def _peak_activation_bytes(swap: bool) -> int:
    gc.collect()
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=16, n_head=8, d_model=512, seq_len=512, vocab_size=256)
    model = GPT(cfg).cuda()
    if swap:
        apply_activation_offload(list(model.blocks), torch.device("cuda"))
    tokens = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len + 1), device="cuda")

    def forward_backward() -> None:
        causal_lm_loss(model(tokens[:, :-1]), (tokens[:, :-1], tokens[:, 1:])).backward()

    forward_backward()  # the gradients now exist and accumulate in place: not counted below
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    static = torch.cuda.memory_allocated()
    forward_backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - static


@pytest.mark.cuda
def test_cuda_swapping_cuts_peak_activation_memory_3x() -> None:
    plain, swapped = _peak_activation_bytes(False), _peak_activation_bytes(True)
    assert plain >= 3 * swapped, (plain, swapped)


@pytest.mark.cuda
def test_cuda_result_equals_cpu_result() -> None:
    grads = []
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        model = GPT(CFG).to(device)
        apply_activation_offload(list(model.blocks), torch.device(device), recompute=list(model.blocks[::2]),
                                 min_bytes=0)
        torch.manual_seed(1)
        _train_once(model, device)
        grads.append({n: p.grad.cpu() for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-5)


def _mlp_blocks() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(4)])


def _device_bytes_after_forward(model: torch.nn.Module, swapper: ActivationSwapper | None) -> int:
    """Live bytes once the forward returned, less the host copies: on the CPU the "host"
    is the device too, so what is swapped out counts once as a copy, here taken away."""
    x = torch.randn(32, 64)
    gc.collect()
    with LiveTensorBytes(ignore=tensors_alive()) as live:
        if swapper is None:
            with torch.no_grad():
                out = model(x)
        else:
            out = model(x)
        kept = live.current_bytes - (swapper.stats.bytes_out if swapper else 0)
    if swapper is not None:
        out.sum().backward()  # the swapped graph is whole
        assert swapper.stats.bytes_in == swapper.stats.bytes_out
    return kept


@pytest.mark.parametrize("recompute", [False, True])
def test_swapped_tensors_leave_the_device_when_the_forward_ends(recompute: bool) -> None:
    model = _mlp_blocks()
    # A forward without grad keeps only the parameters, the input and the output.
    nothing_saved = _device_bytes_after_forward(model, None)
    blocks = list(model)
    swapper = apply_activation_offload(blocks, torch.device("cpu"), recompute=blocks if recompute else (),
                                       pin_memory=False, min_bytes=0)
    # Swapped, nothing saved for backward stays either (checkpointed: the block inputs,
    # the only tensors saved, are the ones that travel).
    assert _device_bytes_after_forward(model, swapper) == nothing_saved
    assert swapper.stats.bytes_out > 0


def test_bf16_weight_casts_saved_as_transposed_views_travel_once_and_come_back_as_views() -> None:
    """Autocast's cache is off in training, so ``linear`` saves a fresh bf16 cast of its
    weight, transposed (not contiguous): it used to stay on the device, 2 bytes per
    parameter of every swapped or streamed block. Views of one storage travel once."""
    grads = []
    for swap in (False, True):
        torch.manual_seed(0)
        lin = torch.nn.Linear(64, 64, bias=False)
        swapper = ActivationSwapper(torch.device("cpu"), min_bytes=0)
        if swap:
            swapper.wrap(lin)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            out = lin(torch.randn(4, 64, requires_grad=True))
        out.float().sum().backward()
        grads.append(lin.weight.grad)
    # The bf16 input cast (4·64·2) and the bf16 weight cast (64·64·2) travel, nothing stays.
    assert swapper.stats.bytes_out == swapper.stats.bytes_in == 4 * 64 * 2 + 64 * 64 * 2
    assert swapper.stats.kept_on_device == 0
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


class _QKV(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 24, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).split(8, dim=-1)  # three views of one (2, 24) storage
        return q * k + v.exp()


def test_views_of_one_storage_travel_once() -> None:
    outs = []
    for swap in (False, True):
        torch.manual_seed(0)
        block, x = _QKV(), torch.randn(2, 8, requires_grad=True)
        swapper = ActivationSwapper(torch.device("cpu"), min_bytes=0)
        if swap:
            swapper.wrap(block)
        block(x).sum().backward()
        outs.append((x.grad, block.proj.weight.grad))
    # x (2·8·4), the projection's output once for q, k and v (2·24·4), and exp's output (2·8·4).
    assert swapper.stats.bytes_out == swapper.stats.bytes_in == 64 + 192 + 64
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
