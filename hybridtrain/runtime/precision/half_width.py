"""Which parameters may cross host⇄device in half precision with exactly the same math.

Under bf16/fp16 autocast, ``F.linear`` is on autocast's lower-precision list: it casts its
fp32 weight and bias to half on the device and computes with the copies. Casting on the
host gives the same bits (both round to nearest even), so such a weight can be uploaded
as half — 2 bytes per parameter instead of 4 — and the forward is unchanged. The gradient
autograd computes for the half copy is half; autocast's cast backward turns it into fp32
exactly, so turning it into fp32 on the host gives the same fp32 gradient, which is then
summed over micro-batches in fp32 in the plain loop's order (never in a half ``.grad``).

The rule (:func:`half_width_params`), decided once from the model's structure:

- the run autocasts to bf16 or fp16 (fp32 runs move fp32, fp64 models fp64);
- the parameter is the ``weight`` or ``bias`` of an ``nn.Linear`` (or a subclass that
  keeps ``nn.Linear.forward``), read only by ``F.linear``, or of Hugging Face's GPT-2
  style ``Conv1D`` (its own forward), read only by ``torch.addmm`` — both on the list;
- the parameter is fp32 and registered in exactly one module, and that module is
  registered exactly once in the model — a weight tied to an embedding or a head, or a
  Linear reused in two places, is read by another op (or summed over two uses in fp32),
  so it keeps fp32 both ways;
- everything else (norms, embeddings, convolutions) keeps fp32 both ways.

What the structure cannot show — a Linear called twice in one forward (a loop, DoRA's
``lora_A``/``lora_B``), a weight a parent also reads with its own arithmetic (DoRA's norm
of the base weight), a reused block — is learnt from the ops at run time:

- layer streaming moves everything fp32 in the first training step while
  :class:`WeightReads` watches each block's forward; afterwards the candidates read
  exactly once, by ``F.linear``/``addmm``, cross in half, the others stay fp32 (and a half
  Linear that later runs twice in one forward is refused with an error naming it);
- optimizer offload narrows a gradient only when the backward's graph shows one cast as
  its only use (:func:`cast_once`), which also rules out a regularizer in the loss;
  otherwise it crosses in fp32. Its updated weights go up in half when every backward of
  the step read them only through casts (:mod:`~hybridtrain.runtime.offload.half_uploads`).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Collection
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from hybridtrain.compat import tree_leaves

HALF_DTYPES = (torch.bfloat16, torch.float16)


def matmul_reads_only(module: nn.Module) -> bool:
    """Whether ``module``'s own forward reads its ``weight`` and ``bias`` only through one
    op on autocast's lower-precision list: ``nn.Linear.forward`` (``F.linear``), or the
    forward of Hugging Face's ``Conv1D`` (``torch.addmm``; looked up only when
    ``transformers`` is already imported, which a model of it has done)."""
    if isinstance(module, nn.Linear):
        return type(module).forward is nn.Linear.forward
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    return conv1d is not None and isinstance(module, conv1d) and type(module).forward is conv1d.forward


def half_width_params(model: nn.Module, compute_dtype: torch.dtype | None, world: int = 1) -> dict[int, torch.dtype]:
    """The parameters (by ``id``) that travel in ``compute_dtype`` instead of fp32, by the
    rule in the module docstring. Pure: reads the model, changes nothing.

    Args:
        model: the whole model (sharing is judged across all of it).
        compute_dtype: the autocast dtype of the run (``None``: fp32, nothing is half).
        world: processes of the run; half-width transfers are one process's (several:
            nothing is half).

    Returns:
        ``{id(parameter): half dtype}``; empty when nothing qualifies.
    """
    if compute_dtype not in HALF_DTYPES or world != 1:
        return {}
    assert compute_dtype is not None
    registered = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    owners: Counter[int] = Counter()
    for _, module in model.named_modules(remove_duplicate=False):
        for _, p in module.named_parameters(recurse=False, remove_duplicate=False):
            owners[id(p)] += 1
    half: dict[int, torch.dtype] = {}
    for module in model.modules():
        if not matmul_reads_only(module) or registered[id(module)] != 1:
            continue
        for p in (module.weight, getattr(module, "bias", None)):
            if isinstance(p, nn.Parameter) and p.dtype == torch.float32 and owners[id(p)] == 1:
                half[id(p)] = compute_dtype
    return half


def cast_once(loss: torch.Tensor, params: Collection[int]) -> set[int]:
    """The ``params`` (by ``id``) whose gradient in ``loss``'s graph comes from exactly one
    use, a cast (``ToCopyBackward0``: autocast's cast to half), so it is one half gradient
    widened to fp32 and narrowing it back is exact. A Linear called twice, a weight also
    read by other ops (a parent's arithmetic, a regularizer in the loss) or recomputed
    inside a reentrant checkpoint (not in this graph) is not among them."""
    return graph_uses(loss, params)[0]


def graph_uses(loss: torch.Tensor, params: Collection[int]) -> tuple[set[int], set[int], set[int]]:
    """``(cast_once, not_cast, read)``: the ``params`` read in ``loss``'s graph only through
    one cast (:func:`cast_once`), those read in it by any op that is not a cast, and all
    it reads. (Autocast runs without its weight-cast cache, so a Linear called twice casts
    its weight twice: read, in neither of the others.)"""
    root = loss.grad_fn
    if root is None or not params:
        return set(), set(), set()
    edges: Counter[int] = Counter()
    casts: Counter[int] = Counter()
    seen = {root}
    stack = [root]
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            var = getattr(nxt, "variable", None)  # an AccumulateGrad: the leaf it fills
            if isinstance(var, torch.Tensor) and id(var) in params:
                edges[id(var)] += 1
                casts[id(var)] += node.name() == "ToCopyBackward0"
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    once = {i for i, n in edges.items() if n == 1 and casts[i] == 1}
    return once, {i for i, n in edges.items() if casts[i] < n}, set(edges)


_HALF_READERS = (torch.nn.functional.linear, torch.addmm)
"""The ops the rule's modules read their weights with (both on autocast's lower-precision list)."""

_METADATA = frozenset({"dtype", "shape", "device", "requires_grad", "is_cuda", "is_leaf", "grad_fn", "ndim",
                       "layout", "is_sparse", "is_quantized", "is_meta", "names", "grad", "itemsize", "nbytes"})
"""Tensor properties that read no values (T5 compares a weight's dtype, for example)."""

_NO_VALUES = frozenset({"untyped_storage", "storage", "data_ptr", "size", "dim", "numel", "nelement", "stride",
                        "storage_offset", "element_size", "is_contiguous", "is_floating_point", "get_device",
                        "is_complex", "is_pinned", "__set__"})
"""Tensor methods that read no values (the activation swapper asks parameters for their
storage; the streamer sets ``.data``)."""


class WeightReads(TorchFunctionMode):
    """While active (in this thread), counts how each watched parameter is read: ``uses``
    by any torch function, ``other`` the parameters read by anything but ``F.linear`` or
    ``torch.addmm`` (a parent's own arithmetic on a child's weight, as DoRA's weight norm).

    Args:
        watched: ids of the parameters to watch.
    """

    def __init__(self, watched: set[int]) -> None:
        super().__init__()
        self.watched = watched
        self.uses: Counter[int] = Counter()
        self.other: set[int] = set()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        metadata = name == "__get__" and getattr(getattr(func, "__self__", None), "__name__", "") in _METADATA
        if not (metadata or name in _NO_VALUES):
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor) and id(leaf) in self.watched:
                    self.uses[id(leaf)] += 1
                    if func not in _HALF_READERS:
                        self.other.add(id(leaf))
        return func(*args, **kwargs)
