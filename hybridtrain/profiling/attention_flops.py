"""FLOPs of the fused scaled-dot-product attention kernels, grouped key/value heads included.

``F.scaled_dot_product_attention(..., enable_gqa=True)`` (Hugging Face's Llama, Mistral, Qwen …
without a padding mask) hands the CUDA and CPU flash kernels key/value tensors with fewer
heads than the query. torch's own formulas (``torch.utils.flop_counter.sdpa_flop_count``)
accept that only from torch 2.13 on; torch 2.11's raise ``AssertionError`` and stop the
counted step. These formulas give every torch the same count, the one torch 2.13 gives: the
kernel broadcasts each key/value head to its group of query heads, so the work is that of
``query_heads`` full heads.

The table :data:`ATTENTION_FLOP_FORMULAS` is for ``FlopCounterMode(custom_mapping=...)``;
each formula takes the kernel's arguments (tensors, or their shapes) in the kernel's order,
``query, key, value, ...`` forward and ``grad_out, query, key, value, ...`` backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import flop_counter

from hybridtrain.compat import ATTENTION_OP_NAMES

_aten = torch.ops.aten


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else tuple(x)


def _full_heads(query: Sequence[int], kv: Sequence[int]) -> tuple[int, ...]:
    """A key/value shape ``(B, H_kv, S, D)`` as the ``(B, H_q, S, D)`` the kernel broadcasts it to.

    Raises:
        ValueError: the query's heads are not a multiple of the key/value heads.
    """
    heads_q, heads_kv = query[1], kv[1]
    if heads_kv == heads_q:
        return tuple(kv)
    if heads_kv <= 0 or heads_q % heads_kv:
        raise ValueError(f"attention FLOPs: query heads {heads_q} are not a multiple of key/value heads {heads_kv}")
    return (kv[0], heads_q, *kv[2:])


def sdpa_flops(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    """Forward FLOPs of one fused attention call (``Q·Kᵀ`` and ``P·V``, every query head)."""
    q = _shape(query)
    return int(flop_counter.sdpa_flop_count(q, _full_heads(q, _shape(key)), _full_heads(q, _shape(value))))


def sdpa_backward_flops(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    """Backward FLOPs of one fused attention call (the scores recomputed, four more matmuls)."""
    q = _shape(query)
    return int(flop_counter.sdpa_backward_flop_count(_shape(grad_out), q, _full_heads(q, _shape(key)),
                                                     _full_heads(q, _shape(value))))


def raw_formula(formula: Callable[..., int]) -> Callable[..., int]:
    """``formula`` marked so ``FlopCounterMode`` hands it the operator's own arguments, as it
    does its table's formulas (profiling/counting.py wraps both alike); these read shapes
    from either."""
    formula._get_raw = True  # type: ignore[attr-defined]
    return formula


_FORWARD = ATTENTION_OP_NAMES

ATTENTION_FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    **{getattr(_aten, name): raw_formula(sdpa_flops) for name in _FORWARD if hasattr(_aten, name)},
    **{getattr(_aten, f"{name}_backward"): raw_formula(sdpa_backward_flops) for name in _FORWARD
       if hasattr(_aten, f"{name}_backward")},
}
"""Formulas for the fused attention kernels (torch's table lacks the CPU ones, and before
torch 2.13 refuses grouped key/value heads), by operator."""
