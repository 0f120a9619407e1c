"""FLOP counting of a real step: a GPT block's count is the analytic one, and backward is
measured (checkpointing's recomputation shows up in it), not assumed to be 2× forward."""

from __future__ import annotations

import torch

import hybridtrain as ht
from hybridtrain.models.gpt import GPT, GPTConfig, causal_lm_loss
from hybridtrain.profiling.counting import count_step, profiled_modules

B, T, D, H, V, LAYERS = 2, 16, 32, 2, 64, 2


def _engine(**config: object) -> tuple[ht.Engine, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=LAYERS, n_head=H, d_model=D, seq_len=T, vocab_size=V))
    engine = ht.initialize(model, {"device": "cpu", "train_micro_batch_size_per_gpu": B, **config},
                           loss_fn=causal_lm_loss)
    ids = torch.randint(0, V, (B, T + 1))
    return engine, (ids[:, :-1], ids[:, 1:])


def _mm(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


def _block_forward() -> tuple[int, int]:
    """A block's forward FLOPs: its linear layers' matmuls, and the attention's two."""
    tokens = B * T
    linear = _mm(tokens, D, 3 * D) + _mm(tokens, D, D) + _mm(tokens, D, 4 * D) + _mm(tokens, 4 * D, D)
    attention = _mm(T, T, D // H) * B * H * 2  # Q·Kᵀ and P·V, every head
    return linear, attention


def test_gpt_block_flops_equal_the_analytic_count() -> None:
    engine, batch = _engine()
    count = count_step(engine, batch)
    linear, attention = _block_forward()
    blocks = [m for m in count.modules if m.kind == "block"]
    assert [m.name for m in blocks] == ["blocks.0", "blocks.1"]
    for block in blocks:
        assert block.forward_flops == linear + attention
        # Backward: two matmuls per linear layer (input and weight gradients); the
        # attention kernel's backward does five T×T matmuls (it recomputes the scores).
        assert block.backward_flops == 2 * linear + 5 * attention // 2
        assert block.params == sum(p.numel() for p in engine.module.blocks[0].parameters())
        assert block.saved_bytes > 0
    head = next(m for m in count.modules if m.name == "head")
    assert head.forward_flops == _mm(B * T, D, V) and head.backward_flops == 2 * head.forward_flops
    assert head.params == 0  # tied to the token embedding, counted there
    assert count.forward_flops == sum(m.forward_flops for m in count.modules)
    assert count.peak_live_bytes > sum(p.numel() * 4 for p in engine.module.parameters())
    assert [part for _, part in count.parts][:2] == ["forward", None]


def test_backward_is_measured_recomputation_included() -> None:
    plain, batch = _engine()
    checkpointed, _ = _engine(activation_checkpointing={"enabled": True})
    base, recomputed = count_step(plain, batch), count_step(checkpointed, batch)
    for a, b in zip(base.modules, recomputed.modules, strict=True):
        assert a.forward_flops == b.forward_flops
        if a.kind == "block":
            # The block's forward runs again inside backward, up to the last tensor backward
            # needs: torch's checkpoint stops before the MLP's output matmul (its output is
            # not saved), so a rule such as "backward = 3 × forward" would be wrong here.
            last_matmul = _mm(B * T, 4 * D, D)
            assert b.backward_flops == a.backward_flops + a.forward_flops - last_matmul
            assert b.saved_bytes < a.saved_bytes
        else:
            assert b.backward_flops == a.backward_flops


def test_profiled_modules_are_blocks_embeddings_and_head() -> None:
    engine, _ = _engine()
    kinds = {name: kind for name, kind, _ in profiled_modules(engine.module)}
    assert kinds == {"tok_emb": "embedding", "pos_emb": "embedding", "blocks.0": "block", "blocks.1": "block",
                     "ln_f": "head", "head": "head"}


def _rows(count: object) -> list[tuple[str, int, int, int]]:
    return [(m.name, m.forward_flops, m.backward_flops, m.saved_bytes) for m in count.modules]  # type: ignore[attr-defined]


def test_layer_major_counts_the_forwards_its_worker_threads_run() -> None:
    """Layer-major streaming runs each micro-batch's forward in a worker thread (taking turns
    at every block) and backwards each block from its cut output: the counts join the
    workers and keep each thread's running modules, so the step counts as without it."""
    two = {"train_micro_batch_size_per_gpu": B // 2, "gradient_accumulation_steps": 2}
    plain, batch = _engine(**two)
    kept, _ = _engine(**two, layer_streaming={"enabled": True, "layer_major": True, "boundary_activations": "device"})
    base, layer_major = count_step(plain, batch), count_step(kept, batch)
    assert (layer_major.forward_flops, layer_major.backward_flops) == (base.forward_flops, base.backward_flops)
    assert [row[:3] for row in _rows(layer_major)] == [row[:3] for row in _rows(base)]
    assert all(m.forward_flops > 0 and m.backward_flops > 0 for m in layer_major.modules if m.kind == "block")
    # With recomputation: equal to micro-batch-major streaming's, saved bytes per micro-batch included.
    streamed, _ = _engine(**two, layer_streaming={"enabled": True})
    recomputed, _ = _engine(**two, layer_streaming={"enabled": True, "layer_major": True})
    assert _rows(count_step(recomputed, batch)) == _rows(count_step(streamed, batch))
