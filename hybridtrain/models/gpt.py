"""Reference decoder-only transformer (GPT) whose blocks are a ``ModuleList`` of identical
blocks, in named sizes from ``gpt-tiny`` (seconds on a CPU) to ``gpt-13b`` (GPU benchmarks;
build it on the meta device to estimate without allocating)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a reference GPT."""

    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64
    seq_len: int = 64
    vocab_size: int = 256
    dropout: float = 0.0
    tie_embeddings: bool = True


GPT_SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, n_head=2, d_model=64, seq_len=64),
    "mini": GPTConfig(n_layer=4, n_head=4, d_model=128, seq_len=128),
    "small": GPTConfig(n_layer=6, n_head=6, d_model=384, seq_len=256),
    "125m": GPTConfig(n_layer=12, n_head=12, d_model=768, seq_len=1024),
    "350m": GPTConfig(n_layer=24, n_head=16, d_model=1024, seq_len=1024),
    "760m": GPTConfig(n_layer=24, n_head=16, d_model=1536, seq_len=1024),
    "1.3b": GPTConfig(n_layer=24, n_head=32, d_model=2048, seq_len=1024),
    "2.7b": GPTConfig(n_layer=32, n_head=32, d_model=2560, seq_len=1024),
    "6.7b": GPTConfig(n_layer=32, n_head=32, d_model=4096, seq_len=1024),
    "13b": GPTConfig(n_layer=40, n_head=40, d_model=5120, seq_len=1024),
}


def gpt_config(size: str, **overrides: Any) -> GPTConfig:
    """The named size (``tiny`` … ``13b``, with or without a ``gpt-`` prefix) with overrides.

    Raises:
        ValueError: unknown size or unknown override field.
    """
    key = size.removeprefix("gpt-")
    if key not in GPT_SIZES:
        raise ValueError(f"model.name 'gpt-{key}' is unknown; allowed: "
                         + ", ".join(f"gpt-{k}" for k in GPT_SIZES))
    names = {f.name for f in fields(GPTConfig)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"model.overrides {unknown} are not GPT fields; allowed: {sorted(names)}")
    for name, value in overrides.items():
        check_override(name, value)
    cfg = replace(GPT_SIZES[key], **overrides)
    if cfg.d_model % cfg.n_head:
        raise ValueError(f"model d_model={cfg.d_model} is not divisible by n_head={cfg.n_head}")
    return cfg


_POSITIVE_INTS = ("n_layer", "n_head", "d_model", "seq_len", "vocab_size")


def check_override(name: str, value: Any) -> None:
    """Refuse a GPT field value of the wrong type or range, in one line naming it.

    Raises:
        ValueError: ``model.overrides.<name> = <value>`` and what is allowed.
    """
    if name in _POSITIVE_INTS:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        allowed = "an integer ≥ 1"
    elif name == "dropout":
        ok = isinstance(value, int | float) and not isinstance(value, bool) and 0.0 <= value < 1.0
        allowed = "a number in [0, 1)"
    else:  # tie_embeddings
        ok, allowed = isinstance(value, bool), "true or false"
    if not ok:
        raise ValueError(f"model.overrides.{name} = {value!r}: must be {allowed}")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (fused QKV projection, SDPA kernel)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # (B, T, C)
        # Head counts come from the tensor, not n_head: under tensor parallel this rank's
        # qkv shard holds [q; k; v] of its own heads only.
        q, k, v = self.qkv(x).chunk(3, dim=2)
        # (B, H, T, C/H)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(b, t, -1)  # (B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network (4× expansion, GELU)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer: embeddings → ``blocks`` (a ModuleList) → norm → head.

    ``forward(idx)`` maps token ids ``(B, T)`` to logits ``(B, T, vocab)``; use
    :func:`causal_lm_loss` as the engine's ``loss_fn``. With ``tie_embeddings`` the head
    shares the token embedding's weight.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2's initialization, in place: what the constructor does, and what a model
        built on the meta device and materialized (``to_empty``, each rank its shard) calls
        to get weights. On sharded parameters each rank initializes its own shard."""
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections keeps the residual stream's
        # variance independent of depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    def _apply(self, fn: Any, recurse: bool = True) -> GPT:
        # ``to_empty`` (materialising a meta-device build) makes a new parameter per module,
        # which would untie the head from the embedding: tie them again.
        super()._apply(fn, recurse)
        if self.config.tie_embeddings and self.head.weight is not self.tok_emb.weight:
            self.head.weight = self.tok_emb.weight
        return self

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):  # the constructor's values (no random draw)
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    # Tensor parallel: the plan lives with the model (as in torchtitan) and
    # hybridtrain.parallel.tensor discovers these methods by name, so parallel code never
    # imports this module.

    def tensor_parallel_plan(self) -> dict[str, str]:
        """Megatron-style tensor-parallel plan: module-path pattern → ``colwise``/``rowwise``.

        In each block the fused ``qkv`` and ``mlp.fc`` are split by output columns and the
        projections after them by input rows, so each pair needs one all-reduce.
        """
        return {"blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise",
                "blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"}

    def tensor_parallel_heads(self) -> dict[str, int]:
        """Head counts a tensor-parallel size must divide (heads are never split)."""
        return {"n_head": self.config.n_head}

    def tensor_parallel_fused_qkv(self) -> list[str]:
        """Patterns of the Linear layers whose output rows are a fused ``[Q; K; V]``.

        A plain column split would hand one rank all of Q, so tensor parallel interleaves
        these rows per rank first.
        """
        return ["blocks.*.attn.qkv"]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.shape  # (B, T)
        if t > self.config.seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds the model's seq_len={self.config.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, V)


def causal_lm_loss(outputs: Any, batch: Any) -> torch.Tensor:
    """Mean next-token cross-entropy; ``batch`` is ``(inputs, targets)`` and ``outputs`` the
    logits ``(B, T, V)`` or an object with ``.logits`` (Hugging Face)."""
    logits = getattr(outputs, "logits", outputs)
    targets = batch[1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def build_gpt(name: str = "gpt-tiny", device: str | torch.device | None = None,
              **overrides: Any) -> GPT:
    """Build a reference GPT by size name; ``device="meta"`` allocates nothing. Without
    ``device`` the default device applies (an enclosing ``with torch.device(...)``)."""
    cfg = gpt_config(name, **overrides)
    if device is None:
        return GPT(cfg)
    with torch.device(device):
        return GPT(cfg)


def gpt_param_count(cfg: GPTConfig) -> int:
    """Parameters of a reference GPT, computed without building it."""
    d = cfg.d_model
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    emb = cfg.vocab_size * d + cfg.seq_len * d
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    return emb + cfg.n_layer * block + 2 * d + head
