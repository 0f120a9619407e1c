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
- everything else (norms, embeddings, convolutions, parameters read directly by a
  parent's forward) keeps fp32 both ways.

What the rule cannot see statically — a Linear called twice in one forward from a loop —
is refused at run time by the streamer (:class:`~hybridtrain.runtime.streaming.LayerStreamer`):
its gradients would be summed in half precision instead of fp32.
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
from torch import nn

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


def half_width_params(model: nn.Module, compute_dtype: torch.dtype | None) -> dict[int, torch.dtype]:
    """The parameters (by ``id``) that travel in ``compute_dtype`` instead of fp32, by the
    rule in the module docstring. Pure: reads the model, changes nothing.

    Args:
        model: the whole model (sharing is judged across all of it).
        compute_dtype: the autocast dtype of the run (``None``: fp32, nothing is half).

    Returns:
        ``{id(parameter): half dtype}``; empty when nothing qualifies.
    """
    if compute_dtype not in HALF_DTYPES:
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
