"""Tiny random configs for any Hugging Face architecture, derived generically from the
config class's defaults (used by ``scripts/hf_family_sweep.py``).

Every size-like field is shrunk by its name (hidden sizes to 32, feed-forward sizes to 64,
layers to 2, heads to 4 with 2 key/value heads, head sizes to 8, vocabularies to 96,
experts to 4 with 2 per token, positions to 64), every dropout / jitter / layer-drop is 0,
and special token ids that fall outside the small vocabulary are moved to 0-3. Nested
configs (``text_config``, ``vision_config`` …) are shrunk by the same rules. Where the rules
alone give an inconsistent config, :data:`OVERRIDES` adds the few fields a family needs.

Nothing is downloaded. Transformers is imported lazily.
"""

from __future__ import annotations

from typing import Any

HIDDEN = 32
FFN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 8
VOCAB = 96
EXPERTS = 4
TOP_K = 2
POSITIONS = 64
SPECIAL_IDS = 4
"""Token ids below this are reserved for special tokens; batches draw ids from here up."""

_HIDDEN_KEYS = {"hidden_size", "d_model", "n_embd", "embed_dim", "dim", "model_dim", "emb_dim", "d_embed",
                "embedding_size", "word_embed_proj_dim", "embedding_dim", "n_embed", "hidden_dim"}
_LAYER_KEYS = {"num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers", "decoder_layers",
               "num_decoder_layers", "num_encoder_layers", "depth", "num_blocks", "n_layers_per_block"}
_HEAD_KEYS = {"num_attention_heads", "n_head", "num_heads", "encoder_attention_heads", "decoder_attention_heads",
              "n_heads", "num_decoder_attention_heads", "attention_heads"}
_KV_KEYS = {"num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv",
            "num_kv_groups"}
_HEAD_DIM_KEYS = {"head_dim", "d_kv", "attention_head_dim", "kv_channels", "qk_nope_head_dim", "qk_rope_head_dim",
                  "v_head_dim", "attention_head_size", "head_size", "linear_key_head_dim", "linear_value_head_dim"}
_EXPERT_KEYS = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts",
                "n_experts", "num_experts_total"}
_TOP_K_KEYS = {"num_experts_per_tok", "top_k", "moe_topk", "num_experts_per_token", "moe_k", "num_selected_experts",
               "experts_per_token", "moe_top_k"}
_POSITION_KEYS = {"max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length",
                  "seq_length"}
_RANK_KEYS = {"kv_lora_rank", "q_lora_rank"}
_MAMBA = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16, "state_size": 16, "mamba_chunk_size": 8,
          "chunk_size": 8, "time_step_rank": 8, "mamba_dt_rank": 8, "mamba_headdim": 16, "n_mamba_heads": 4,
          "adapter_rank": 8, "laurel_rank": 8, "num_kv_shared_layers": 0, "linear_num_heads": 4,
          "linear_head_dim": HEAD_DIM, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
          "num_query_groups": 4, "num_expert_group": 1, "vocab_size_per_layer_input": VOCAB}
"""State-space blocks: heads × head size = expand (2) × hidden."""

_HYBRID_ATTENTION = {"attn_layer_period": 2, "attn_layer_offset": 1}
"""Hybrid state-space models: attention in the second of the two layers."""
OVERRIDES: dict[str, dict[str, Any]] = {
    "bailing_hybrid": {"layer_group_size": 2},
    "bamba": {"attn_layer_indices": [1]},
    "deepseek_v2": {"num_experts_per_tok": TOP_K},
    "dots3_note_text": {"head_dim": 2 * HEAD_DIM},
    "dots1": {"n_routed_experts": EXPERTS, "num_experts_per_tok": TOP_K, "n_shared_experts": 1},
    "encoder-decoder": {"pad_token_id": 0, "decoder_start_token_id": 2,
                        "decoder": {"is_decoder": True, "add_cross_attention": True}},
    "esm": {"vocab_size": VOCAB, "pad_token_id": 1, "mask_token_id": 3},
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
    "jamba": _HYBRID_ATTENTION,
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "mamba2": {"head_dim": 16, "n_groups": 1},
    "mobilebert": {"intra_bottleneck_size": HIDDEN},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "neomme": {"head_dim": 16},
    "perceiver": {"max_position_embeddings": 16, "num_latents": 8, "d_latents": HIDDEN},
    "reformer": {"axial_pos_embds_dim": [16, 16], "axial_pos_shape": [4, 4], "lsh_attn_chunk_length": 8,
                 "local_attn_chunk_length": 8, "attn_layers": ["local", "lsh"], "hash_seed": 0,
                 "num_buckets": 2, "attention_head_size": HEAD_DIM, "feed_forward_size": FFN},
    # Speech tokenizers double their channels per stage: 32 filters end at 2048 (686M parameters).
    "vibevoice_asr": {f"{kind}_tokenizer_encoder_config": {"num_filters": 4, "depths": [1] * 7}
                      for kind in ("acoustic", "semantic")},
    "xlstm": {"chunk_size": 16, "mode": "train"},
    # Zamba ties one shared attention block across its hybrid layers: it needs two of them.
    "zamba": {**_HYBRID_ATTENTION, "attention_hidden_size": 2 * HIDDEN, "attention_head_dim": 16,
              "num_hidden_layers": 4, "layers_block_type": ["linear_attention", "hybrid"] * 2},
    "zamba2": {"attention_hidden_size": 2 * HIDDEN, "attention_head_dim": 16, "hybrid_layer_ids": [1]},
}
"""Per ``model_type``: fields the generic rules cannot derive, or defaults the family itself
cannot build from (applied last; a nested config's fields merge into its generic ones)."""

_SIZE_BY_KEYS: tuple[tuple[frozenset[str] | set[str], int], ...] = (
    (_LAYER_KEYS, LAYERS), (_KV_KEYS, KV_HEADS), (_HEAD_KEYS, HEADS), (_HEAD_DIM_KEYS, HEAD_DIM),
    (_EXPERT_KEYS, EXPERTS), (_TOP_K_KEYS, TOP_K), (_POSITION_KEYS, POSITIONS), (_RANK_KEYS, 16))
"""Exact key names and the size they shrink to, checked in this order."""


def _shrunk_value(key: str, value: Any) -> Any:
    """The tiny value of one config field, or ``value`` when it is not size-like."""
    if value is None and key in _HEAD_DIM_KEYS | {"head_dim"}:
        return HEAD_DIM  # "derive it" defaults some modeling code never derives
    if value is None and key in _KV_KEYS:
        return HEADS
    if isinstance(value, bool):
        return value
    if isinstance(value, float):
        if any(word in key for word in ("dropout", "pdrop", "layerdrop", "drop_path", "jitter", "drop_rate")):
            return 0.0
        return value
    if not isinstance(value, int):
        return value
    small: int | None = None
    if key in _HIDDEN_KEYS or (key.endswith("hidden_size") and "intermediate" not in key) or (
            key.startswith("adapter_") and key.endswith(("_dim", "_size"))):
        small = HIDDEN
    elif "intermediate" in key or "ffn" in key or key in {"d_ff", "n_inner", "inner_dim"}:
        small = FFN
    elif (exact := next((size for keys, size in _SIZE_BY_KEYS if key in keys), None)) is not None:
        small = exact
    elif key.endswith("vocab_size") and not key.startswith("type_"):
        small = VOCAB
    elif key == "rotary_dim":
        small = HEAD_DIM // 2
    elif key in {"n_group", "topk_group", "first_k_dense_replace"}:
        small = 1  # expert groups: one group of the few experts; one dense layer, then MoE
    elif key in _MAMBA:
        small = _MAMBA[key]
    if small is None or value <= 0:
        return value
    return min(value, small)


def _token_id(key: str, value: Any, vocab: int) -> Any:
    """Special token ids past the tiny vocabulary move into the reserved ids."""
    if not (key.endswith("token_id") or key.endswith("token_index") or key.endswith("_token_ids")):
        return value
    if isinstance(value, list):
        return [_token_id(key, v, vocab) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and value >= vocab:
        return SPECIAL_IDS - 1
    return value


def tiny_overrides(defaults: dict[str, Any], model_type: str | None = None) -> dict[str, Any]:
    """The fields of a config's ``to_dict()`` to change, nested configs as dicts."""
    out: dict[str, Any] = {}
    vocab = min(defaults.get("vocab_size") or VOCAB, VOCAB)
    layers = defaults.get("num_hidden_layers")
    heads = defaults.get("num_attention_heads")
    for key, value in defaults.items():
        if key.startswith("_") or key in {"transformers_version", "architectures", "id2label", "label2id"}:
            continue
        if key == "per_layer_config":
            continue  # below
        if isinstance(value, dict) and ("model_type" in value or key.endswith("_config")):
            # Only the changed fields: the nested config class fills in its own defaults.
            nested = tiny_overrides(value, value.get("model_type"))
            if nested:
                # (with its model_type: a composite config picks the nested class by it)
                out[key] = {**({"model_type": value["model_type"]} if value.get("model_type") else {}), **nested}
            continue
        new = _token_id(key, _shrunk_value(key, value), vocab)
        if key in _KV_KEYS and value == heads:
            new = HEADS  # multi-head attention stays multi-head (some families allow no other)
        if isinstance(value, list) and isinstance(layers, int) and len(value) == layers and layers > LAYERS:
            # Per-layer lists (layer_types, …) follow the layer count, keeping every kind of
            # layer the pattern has (3 × linear + 1 × full attention: linear, full).
            kinds = [v for i, v in enumerate(value) if v not in value[:i]]
            new = (kinds + value)[:LAYERS]
        if new != value:
            out[key] = new
    rope, nope = defaults.get("qk_rope_head_dim"), defaults.get("qk_nope_head_dim")
    if isinstance(rope, int) and isinstance(nope, int) and defaults.get("head_dim") == rope + nope:
        out["head_dim"] = 2 * HEAD_DIM  # latent attention whose head is the nope and rope parts together
    for key, value in OVERRIDES.get(model_type or defaults.get("model_type", ""), {}).items():
        out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) and key in defaults else value
    if isinstance(defaults.get("per_layer_config"), dict):
        # Settings per layer index keep the layers that still exist; per layer type, shrunk.
        out["per_layer_config"] = {
            k: {**v, **tiny_overrides(v)} if isinstance(v, dict) else v
            for k, v in defaults["per_layer_config"].items() if not str(k).isdigit() or int(k) < LAYERS}
    return out


def tiny_config(config_class: Any) -> Any:
    """``config_class`` with its defaults shrunk (see the module docstring).

    An encoder–decoder config without a ``decoder_start_token_id`` (T5's defaults have none:
    its checkpoints set it) gets its pad id, as T5's checkpoints do."""
    model_type = getattr(config_class, "model_type", None)
    try:
        defaults = config_class().to_dict()
    except Exception:  # noqa: BLE001 - some families' own defaults fail their validation
        defaults = config_class(**OVERRIDES.get(model_type or "", {})).to_dict()
    overrides = tiny_overrides(defaults, model_type)
    if defaults.get("is_encoder_decoder") and defaults.get("decoder_start_token_id") is None:
        pad = overrides.get("pad_token_id", defaults.get("pad_token_id"))
        overrides.setdefault("decoder_start_token_id", pad if isinstance(pad, int) else 0)
    return config_class(**overrides)
