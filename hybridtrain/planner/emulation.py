"""What the meta device does differently from a real one, and the techniques' memory
behaviour, emulated for the trace (:mod:`hybridtrain.planner.trace`).

- :class:`MetaAutocast`: autocast has no meta backend. Matmul-like functions receive
  their floating inputs cast to the compute dtype; the engine's autocast runs without
  the weight-cast cache (``runtime/precision/scaling.py``), so every cast is a fresh tensor, as
  here. It also runs ``scaled_dot_product_attention`` as CPU's flash kernel: on meta,
  SDPA takes the math path and saves the ``T × T`` attention matrix, while CPU and CUDA
  run flash kernels that save only the output and the log-sum-exp.
- :class:`SwapEmulation`: activation swapping's pack rule (``runtime/activation_offload``)
  on meta tensors. A saved tensor that would be swapped becomes a *host copy*: on a CPU
  target a new meta tensor (host and device are one memory, and the copy is live
  memory there), on a GPU target a handle counting host bytes; the original is held
  until the block's forward ends, as the swapper holds it.
- :class:`Recompute`: a checkpointed block (its inputs kept, through the swap hooks when
  it is also swapped, as the engine's checkpoint-and-swap), recomputed in backward under
  the emulated autocast (torch function modes are not active inside backward).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hybridtrain.compat import cpu_flash_attention
from hybridtrain.profiling.attention_flops import ATTENTION_FLOP_FORMULAS

# Functions autocast runs in the low-precision dtype (CUDA's and CPU's lists agree on these).
_LOW_PRECISION: set[Callable[..., Any]] = {
    F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm,
    torch.bmm, torch.Tensor.bmm, torch.addmm, torch.baddbmm, torch.addbmm, F.conv1d, F.conv2d, F.conv3d,
    F.scaled_dot_product_attention, torch.einsum,
}
# Functions CUDA's autocast runs in fp32 (their inputs are cast up); CPU's list leaves them alone.
_FP32_ON_CUDA: set[Callable[..., Any]] = {
    F.layer_norm, F.group_norm, F.softmax, F.log_softmax, torch.softmax, torch.log_softmax,
    torch.Tensor.softmax, torch.Tensor.log_softmax, F.cross_entropy, F.nll_loss, torch.rsqrt, torch.exp,
    torch.log, torch.pow, torch.Tensor.pow, torch.sum, torch.norm,
}


class MetaAutocast(TorchFunctionMode):
    """Autocast and flash attention on the meta device (see the module docstring).

    Args:
        dtype: the compute dtype (None: fp32, nothing is cast).
        target: ``cpu`` or ``cuda``: whose autocast lists to follow.
    """

    def __init__(self, dtype: torch.dtype | None, target: str) -> None:
        super().__init__()
        self.dtype = dtype
        self.target = target
        self.enabled = True
        """Off during backward (the engine autocasts the forward and its recomputations)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.enabled and self.dtype is not None:
            if func in _LOW_PRECISION:
                args, kwargs = _cast(args, kwargs, self.dtype)
            elif self.target == "cuda" and func in _FP32_ON_CUDA:
                args, kwargs = _cast(args, kwargs, torch.float32)
        if func is F.scaled_dot_product_attention:
            return _flash_attention(self.target, *args, **kwargs)
        if func in _GROUPED_MM and args and args[0].dtype != torch.bfloat16:
            # Meta's grouped_mm checks CUDA's bf16-only rule; CPU (and Hugging Face's MoE
            # experts there) run it in fp32 too.
            return _GroupedMatmul.apply(args[0], args[1])
        return func(*args, **kwargs)


_GROUPED_MM: set[Callable[..., Any]] = {f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None))
                                         if f is not None}


class _GroupedMatmul(torch.autograd.Function):
    """``grouped_mm(a (S, K), b (E, K, N), offs)`` on meta: an ``(S, N)`` output that saves
    both inputs, as the real kernel's backward does."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a.new_empty((a.shape[0], b.shape[-1]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        return torch.empty_like(a), torch.empty_like(b)


def _cast(args: Any, kwargs: dict[str, Any], dtype: torch.dtype) -> tuple[Any, dict[str, Any]]:
    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


def _flash_attention(target: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                     scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """SDPA as the device runs it: a flash kernel (it takes grouped key/value heads as
    they are), except on a CPU training with dropout, which takes the math path as meta does."""
    math_path = q.dim() != 4 or (target == "cpu" and dropout_p > 0 and torch.is_grad_enabled())
    if math_path:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    if attn_mask is not None and attn_mask.dtype not in (q.dtype, torch.bool):
        attn_mask = attn_mask.to(q.dtype)
    op = cpu_flash_attention()[0]
    out: torch.Tensor = op(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
    return out


FLOP_FORMULAS = {
    op: ATTENTION_FLOP_FORMULAS[op]
    for op in cpu_flash_attention()
}
"""FLOPs of the operators :class:`MetaAutocast` substitutes, for ``FlopCounterMode``."""


class _HostCopy:
    """A saved tensor copied to host memory on a GPU target: its shape, nothing on meta."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape = tensor.shape
        self.dtype = tensor.dtype
        self.nbytes = tensor.numel() * tensor.element_size()


class SwapEmulation:
    """Activation swapping's pack rule on meta tensors (see the module docstring).

    Args:
        target: ``cpu`` or ``cuda``.
        min_bytes: smaller saved tensors stay on the device.
        skip: ids of the storages that stay (parameters and buffers).

    Attributes:
        host_bytes: bytes copied to host memory on a GPU target, per scope index.
    """

    def __init__(self, target: str, min_bytes: int, skip: set[int]) -> None:
        self.target = target
        self.min_bytes = min_bytes
        self.skip = skip
        self.host_bytes: dict[int, int] = {}

    @contextmanager
    def scope(self, index: int) -> Iterator[None]:
        """Swap what autograd saves inside (block ``index``'s forward)."""
        seen: dict[int, tuple[torch.Tensor, Any]] = {}
        self.host_bytes.setdefault(index, 0)

        def pack(tensor: torch.Tensor) -> Any:
            if (tensor.is_sparse or not tensor.is_contiguous()
                    or tensor.numel() * tensor.element_size() < self.min_bytes
                    or id(tensor.untyped_storage()) in self.skip):
                return tensor
            if id(tensor) in seen:  # the same tensor saved twice travels once
                return seen[id(tensor)][1]
            copy: Any = torch.empty_like(tensor) if self.target == "cpu" else _HostCopy(tensor)
            if isinstance(copy, _HostCopy):
                self.host_bytes[index] += copy.nbytes
            seen[id(tensor)] = (tensor, copy)
            return copy
        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield
        seen.clear()


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, _HostCopy):  # copied back to the device for backward
        return torch.empty(packed.shape, dtype=packed.dtype, device="meta")
    tensor: torch.Tensor = packed
    return tensor


class Recompute(torch.autograd.Function):
    """A block that keeps only its inputs and is recomputed in backward: memory-wise
    ``torch.utils.checkpoint`` (non-reentrant) and the engine's checkpoint-and-swap."""

    @staticmethod
    def forward(ctx: Any, run: Callable[..., tuple[torch.Tensor, ...]], autocast: MetaAutocast,
                *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.run = run
        ctx.autocast = autocast
        ctx.save_for_backward(*inputs)
        # Without grad: nothing is kept (the engine runs it with grad and discards what
        # would be saved; the bytes are the same and no model code can unpack a discarded one).
        with torch.no_grad():
            outs = run(*[x.detach() for x in inputs])
        return tuple(o.detach() for o in outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        autocast: MetaAutocast = ctx.autocast
        autocast.enabled = True
        try:
            with torch.enable_grad(), autocast:
                outs = ctx.run(*inputs)
        finally:
            autocast.enabled = False
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *[x.grad if x.requires_grad else None for x in inputs])
