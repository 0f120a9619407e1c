"""Hugging Face model families as equivalence-suite model cases.

One :class:`~tests.equivalence.ModelCase` per family a user would train, each built from a
tiny random config (2 layers, hidden 32, vocab 64, 2-4 heads, every dropout 0, sequences of
16 tokens); nothing is downloaded. Batches are dicts the model takes as ``model(**batch)``
and that make it return ``.loss``:

* causal LMs: ``input_ids`` and ``labels`` (= ``input_ids``; the model shifts them);
* BERT / RoBERTa: ``*ForMaskedLM`` with the same number of masked positions in every row;
* T5 / BART: ``input_ids`` and ``labels`` (the model builds the decoder inputs from them).

Every row has the same number of labelled tokens, so the mean of equal micro-batches' mean
losses is the full batch's mean loss: gradient accumulation is exactly the plain loop's math.

The plain loss is ``model(**batch).loss``: what a plain PyTorch loop over a Hugging Face
model computes (the engine, given no ``loss_fn``, reads the same ``.loss``). It shares no
code with hybridtrain.

Transformers is imported lazily: this module imports without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tests.equivalence import BATCH, SEED, ModelCase, _hf_batches

VOCAB = 64
SEQ = 16
HIDDEN = 32
LAYERS = 2
MASK_TOKEN = 3
MASKED_PER_ROW = 4
"""BERT: masked positions per row (equal in every row, see the module docstring)."""

_DECODER_LLAMA_LIKE: dict[str, Any] = {
    "hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 32, "attention_dropout": 0.0,
}


@dataclass(frozen=True)
class Family:
    """A Hugging Face model family: its classes, tiny config and batch shape."""

    name: str
    model_class: str
    config_class: str
    config: dict[str, Any]
    batches: str = "causal"
    """``causal`` (input_ids + labels), ``masked`` (BERT MLM) or ``seq2seq`` (T5 / BART)."""
    float64: bool = True
    """Whether the model runs in float64 (the suite's fp32 modes use it, see
    tests/models/test_hf_families.py); mixture-of-experts layers that go through torch's
    ``grouped_mm`` have no float64 kernel and stay in fp32."""
    modes: tuple[str, ...] | None = None
    """The suite's modes this family runs in (None: all); a family added for one failure
    class runs the modes that exercise it, which keeps the suite's time in check."""

    @property
    def case_name(self) -> str:
        return f"hf_{self.name}"


FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("gpt2", "GPT2LMHeadModel", "GPT2Config", {
        "n_layer": LAYERS, "n_embd": HIDDEN, "n_head": 2, "vocab_size": VOCAB, "n_positions": 32,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "summary_first_dropout": 0.0,
        "bos_token_id": 0, "eos_token_id": 0}),
    Family("llama", "LlamaForCausalLM", "LlamaConfig", dict(_DECODER_LLAMA_LIKE)),
    Family("mistral", "MistralForCausalLM", "MistralConfig", {**_DECODER_LLAMA_LIKE, "head_dim": 8}),
    Family("qwen2", "Qwen2ForCausalLM", "Qwen2Config", dict(_DECODER_LLAMA_LIKE)),
    Family("qwen3", "Qwen3ForCausalLM", "Qwen3Config", {**_DECODER_LLAMA_LIKE, "head_dim": 8}),
    Family("gemma", "GemmaForCausalLM", "GemmaConfig", {**_DECODER_LLAMA_LIKE, "head_dim": 8}),
    Family("phi", "PhiForCausalLM", "PhiConfig", {
        "hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
        "vocab_size": VOCAB, "max_position_embeddings": 32, "partial_rotary_factor": 0.5,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0}),
    Family("gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig", {
        "hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
        "vocab_size": VOCAB, "max_position_embeddings": 32, "rotary_pct": 0.25,
        "hidden_dropout": 0.0, "attention_dropout": 0.0}),
    Family("opt", "OPTForCausalLM", "OPTConfig", {
        "hidden_size": HIDDEN, "ffn_dim": 64, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
        "word_embed_proj_dim": HIDDEN, "vocab_size": VOCAB, "max_position_embeddings": 32,
        "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0, "layerdrop": 0.0}),
    Family("falcon", "FalconForCausalLM", "FalconConfig", {
        "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": 4, "vocab_size": VOCAB,
        "hidden_dropout": 0.0, "attention_dropout": 0.0}),
    Family("bloom", "BloomForCausalLM", "BloomConfig", {
        "hidden_size": HIDDEN, "n_layer": LAYERS, "n_head": 4, "vocab_size": VOCAB,
        "hidden_dropout": 0.0, "attention_dropout": 0.0}),
    Family("gptj", "GPTJForCausalLM", "GPTJConfig", {
        "n_embd": HIDDEN, "n_layer": LAYERS, "n_head": 4, "rotary_dim": 4, "vocab_size": VOCAB,
        "n_positions": 32, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "bos_token_id": 0, "eos_token_id": 0}),
    Family("mixtral", "MixtralForCausalLM", "MixtralConfig", {
        **_DECODER_LLAMA_LIKE, "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
        "router_jitter_noise": 0.0}, float64=False),
    Family("bert", "BertForMaskedLM", "BertConfig", {
        "hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
        "vocab_size": VOCAB, "max_position_embeddings": 32, "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0}, batches="masked"),
    Family("t5", "T5ForConditionalGeneration", "T5Config", {
        "vocab_size": VOCAB, "d_model": HIDDEN, "d_kv": 8, "d_ff": 64, "num_layers": LAYERS,
        "num_decoder_layers": LAYERS, "num_heads": 4, "relative_attention_num_buckets": 8,
        "dropout_rate": 0.0, "decoder_start_token_id": 0, "pad_token_id": 0}, batches="seq2seq"),
    Family("bart", "BartForConditionalGeneration", "BartConfig", {
        "vocab_size": VOCAB, "d_model": HIDDEN, "encoder_layers": LAYERS, "decoder_layers": LAYERS,
        "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 64,
        "decoder_ffn_dim": 64, "max_position_embeddings": 32, "dropout": 0.0, "attention_dropout": 0.0,
        "activation_dropout": 0.0, "classifier_dropout": 0.0, "encoder_layerdrop": 0.0,
        "decoder_layerdrop": 0.0, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
        "decoder_start_token_id": 2, "forced_eos_token_id": 2}, batches="seq2seq"),
    Family("mamba", "MambaForCausalLM", "MambaConfig", {
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "state_size": 8, "num_hidden_layers": LAYERS,
        "expand": 2, "conv_kernel": 4}),
    # Newer generations and relatives of the above (cheap: a few seconds each).
    Family("gemma2", "Gemma2ForCausalLM", "Gemma2Config", {**_DECODER_LLAMA_LIKE, "head_dim": 8, "sliding_window": 8}),
    Family("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", {
        **_DECODER_LLAMA_LIKE, "head_dim": 8, "sliding_window": 8}),
    Family("phi3", "Phi3ForCausalLM", "Phi3Config", {
        **_DECODER_LLAMA_LIKE, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "pad_token_id": 0, "bos_token_id": 1,
        "eos_token_id": 2}),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", {
        **_DECODER_LLAMA_LIKE, "head_dim": 8, "moe_intermediate_size": 32, "num_experts": 4,
        "num_experts_per_tok": 2}, float64=False),
    Family("olmo2", "Olmo2ForCausalLM", "Olmo2Config", dict(_DECODER_LLAMA_LIKE)),
    Family("gpt_neo", "GPTNeoForCausalLM", "GPTNeoConfig", {
        "hidden_size": HIDDEN, "num_layers": LAYERS, "num_heads": 4, "vocab_size": VOCAB,
        "max_position_embeddings": 32, "attention_types": [[["global", "local"], 1]], "window_size": 8,
        "embed_dropout": 0.0, "attention_dropout": 0.0, "resid_dropout": 0.0, "bos_token_id": 0,
        "eos_token_id": 0}),
    Family("roberta", "RobertaForMaskedLM", "RobertaConfig", {
        "hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
        "vocab_size": VOCAB, "max_position_embeddings": 40, "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0}, batches="masked"),
    Family("mamba2", "Mamba2ForCausalLM", "Mamba2Config", {
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "state_size": 8, "num_hidden_layers": LAYERS, "expand": 2,
        "head_dim": 8, "num_heads": 8, "n_groups": 1, "conv_kernel": 4, "chunk_size": 8}),
    # Found by scripts/hf_family_sweep.py (run in the modes that exercise it): Marian's
    # sinusoidal position table is a frozen parameter (requires_grad False), on which the host
    # optimizer and layer streaming registered gradient hooks.
    Family("marian", "MarianMTModel", "MarianConfig", {
        "vocab_size": VOCAB, "d_model": HIDDEN, "encoder_layers": LAYERS, "decoder_layers": LAYERS,
        "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
        "max_position_embeddings": 32, "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0,
        "pad_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1, "forced_eos_token_id": 2},
        batches="seq2seq", modes=("offload_opt", "offload_opt_accum2_clip", "stream")),
    # XLM hands a key/value cache to its attention layers whatever use_cache says (found by the
    # sweep: recomputation appended to it a second time).
    Family("xlm", "XLMWithLMHeadModel", "XLMConfig", {
        "vocab_size": VOCAB, "emb_dim": HIDDEN, "n_layers": LAYERS, "n_heads": 4, "max_position_embeddings": 32,
        "dropout": 0.0, "attention_dropout": 0.0}, batches="masked",
        modes=("checkpoint", "swap_checkpoint_bf16", "stream")),
    # Jamba alternates two layer classes (state-space, attention) in its one list of blocks
    # (found by the sweep: no same-class list, so no blocks).
    Family("jamba", "JambaForCausalLM", "JambaConfig", {
        **_DECODER_LLAMA_LIKE, "num_hidden_layers": 4,  # each layer class twice, as in a real Jamba
        "num_experts": 4, "num_experts_per_tok": 2, "expert_layer_period": 2,
        "expert_layer_offset": 1, "attn_layer_period": 2, "attn_layer_offset": 1, "mamba_d_state": 8,
        "mamba_dt_rank": 8, "mamba_expand": 2, "use_mamba_kernels": False}, float64=False,
        modes=("checkpoint", "swap", "stream")),
]}


def available(family: Family) -> str | None:
    """``None`` when the installed transformers has the family's classes, else why not."""
    import transformers

    missing = [c for c in (family.model_class, family.config_class) if not hasattr(transformers, c)]
    if missing:
        return f"transformers {transformers.__version__} has no {', '.join(missing)}"
    return None


def build(family: Family, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The family's model from its tiny random config (seeded by the caller), its
    parameters in ``dtype``."""
    import transformers

    config = getattr(transformers, family.config_class)(**family.config)
    return getattr(transformers, family.model_class)(config).to(dtype)


def _masked_batches(steps: int) -> list[Any]:
    gen = torch.Generator().manual_seed(SEED)
    out = []
    for _ in range(steps):
        ids = torch.randint(4, VOCAB, (BATCH, SEQ), generator=gen)
        # The same number of masked positions per row (at random places).
        masked = torch.rand(BATCH, SEQ, generator=gen).argsort(dim=1)[:, :MASKED_PER_ROW]
        labels = torch.full_like(ids, -100)
        labels.scatter_(1, masked, ids.gather(1, masked))
        out.append({"input_ids": ids.scatter(1, masked, MASK_TOKEN), "labels": labels})
    return out


def _seq2seq_batches(steps: int) -> list[Any]:
    gen = torch.Generator().manual_seed(SEED)
    out = []
    for _ in range(steps):
        # Ids from 3 up: no pad / bos / eos inside the sequences.
        source = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
        target = torch.randint(3, VOCAB, (BATCH, SEQ // 2), generator=gen)
        out.append({"input_ids": source, "labels": target})
    return out


_BATCHES: dict[str, Callable[[int], list[Any]]] = {
    "causal": _hf_batches(VOCAB, SEQ),
    "masked": _masked_batches,
    "seq2seq": _seq2seq_batches,
}


def plain_hf_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """A plain PyTorch loop's loss of a Hugging Face model: its own ``.loss``."""
    return model(**batch).loss


def family_case(family: Family, dtype: torch.dtype = torch.float32) -> ModelCase:
    """The equivalence-suite case of ``family`` with parameters in ``dtype``."""
    return ModelCase(name=family.case_name, build=lambda: build(family, dtype), batches=_BATCHES[family.batches],
                     loss_fn=None, plain_loss=plain_hf_loss)


def hf_family_cases() -> dict[str, ModelCase]:
    """Every family's case, keyed by ``hf_<family>``."""
    return {f.case_name: family_case(f) for f in FAMILIES.values()}
