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
is refused at run time by the streamer (:class:`~hybridtrain.runtime.streaming.LayerStreamer`),
whose half weights would sum two half gradients; optimizer offload, whose device weights
stay fp32, counts the calls (:class:`ForwardUses`) and sends such a gradient (an fp32 sum)
down in fp32.
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

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


class ForwardUses:
    """How often each half-width module ran in the forward since the last backward, so a
    gradient is narrowed to half only when it is one widened half gradient (one use).

    A forward pre-hook on every module :func:`half_width_params` took parameters from
    counts calls with gradients enabled while *counting*; :meth:`backward_starts` stops
    counting (a recomputation in backward is no second use: its gradient arrives once),
    :meth:`backward_ended` starts the next forward's count from zero.

    Args:
        model: the model the decision was made for.
        half: its result.
    """

    def __init__(self, model: nn.Module, half: dict[int, torch.dtype]) -> None:
        self._calls: Counter[int] = Counter()
        self._module_of: dict[int, int] = {}
        self._counting = True
        self._handles: list[RemovableHandle] = []
        for module in model.modules():
            owned = [p for p in module.parameters(recurse=False) if id(p) in half]
            if matmul_reads_only(module) and owned:
                self._module_of.update({id(p): id(module) for p in owned})
                self._handles.append(module.register_forward_pre_hook(lambda m, _a: self._called(m)))

    def _called(self, module: nn.Module) -> None:
        if self._counting and torch.is_grad_enabled():
            self._calls[id(module)] += 1

    def single(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s module ran at most once in the forward counted last."""
        module = self._module_of.get(id(param))
        return module is not None and self._calls[module] <= 1

    def backward_starts(self) -> None:
        """Stop counting until :meth:`backward_ended`."""
        self._counting = False

    def backward_ended(self) -> None:
        """The next forward is counted from zero."""
        self._calls.clear()
        self._counting = True

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
