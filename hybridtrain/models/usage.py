"""Where a model's code actually uses each parameter, relative to its blocks.

Module structure says where a parameter *lives*; it does not say where the forward *uses*
it. A tied output head written as ``h @ self.emb.weight.T`` inside ``forward`` uses the
embedding after the last block without calling the embedding module. Pipelines (which
stages must hold and synchronise a parameter) and streaming (which parameters may leave
the device between uses) need the uses, so one forward of an example micro-batch is
traced: a ``TorchFunctionMode`` sees every tensor an operation receives, so every
parameter an operation reads is recorded against the current place — before the first
block, inside block ``i``, between two blocks, or after the last block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

PRE = "pre"
POST = "post"


@dataclass(frozen=True)
class ModelUsage:
    """What one traced forward saw.

    Attributes:
        places: parameter name → where it was used: ``"pre"``, ``"post"``, ``"block:i"``
            (inside block ``i``) or ``"between:i"`` (after block ``i``, before ``i + 1``,
            outside any block). Parameters the forward never used are absent.
        owner: parameter name → index of the block it belongs to (absent: outside blocks).
        boundary: per-sample shape and dtype of the hidden state entering block ``i`` for
            ``i < n`` and leaving the last block at ``n`` (dim 0 is the batch).
        tuple_output: whether blocks return tuples (hidden state first).
        unchained: indices ``i`` of blocks whose hidden state input is not block ``i - 1``'s
            output (code between them changed it, e.g. a residual added outside the blocks).
        batch_major: every block's hidden state has the batch as its dim 0.
    """

    places: dict[str, frozenset[str]]
    owner: dict[str, int]
    boundary: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    tuple_output: bool
    unchained: tuple[int, ...] = ()
    batch_major: bool = True
    hidden_error: str | None = None
    """Why a block's hidden state could not be found (then ``boundary`` is incomplete)."""

    def used_outside_own_block(self) -> dict[str, frozenset[str]]:
        """Block parameters some code outside their own block uses: name → those places."""
        out = {}
        for name, block in self.owner.items():
            foreign = self.places.get(name, frozenset()) - {f"block:{block}"}
            if foreign:
                out[name] = foreign
        return out


class BlockInputError(TypeError):
    """A block was called without a tensor hidden state where blocks take it."""


def hidden_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The hidden state a block is called with: its first positional argument, or the
    ``hidden_states`` keyword (Hugging Face layers).

    Raises:
        BlockInputError: the block was called without a tensor in either place.
    """
    value = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(value, torch.Tensor):
        raise BlockInputError("a block must take its hidden state as the first argument or as "
                        f"hidden_states=, got {type(value).__name__}; set model.blocks to the right list")
    return value


def first_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter)`` → the name state dicts use for it (a shared one's first name)."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    return names


def _parameters_in(value: Any) -> Iterator[nn.Parameter]:
    """Every parameter inside an operation's arguments (tuples, lists and dicts walked)."""
    if isinstance(value, nn.Parameter):
        yield value
    elif isinstance(value, tuple | list):
        for item in value:
            yield from _parameters_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _parameters_in(item)


class _Recorder(TorchFunctionMode):
    def __init__(self, params: dict[int, str], seen: dict[str, set[str]], place: Callable[[], str]) -> None:
        super().__init__()
        self.params = params
        self.seen = seen
        self.place = place

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for param in _parameters_in((args, kwargs)):
            name = self.params.get(id(param))
            if name is not None:
                self.seen.setdefault(name, set()).add(self.place())
        return func(*args, **kwargs)


def trace_usage(model: nn.Module, blocks: Sequence[nn.Module], forward: Callable[[], Any],
                batch: int, precision: Callable[[], AbstractContextManager[Any]] = nullcontext) -> ModelUsage:
    """Run ``forward`` (one forward of ``model`` on an example batch of ``batch`` samples)
    without gradients and record where every parameter is used. The model's buffers
    (BatchNorm statistics) and random generators are as before afterwards.

    Args:
        model: the whole model.
        blocks: its blocks, in execution order.
        forward: calls the model on the example batch.
        batch: the example's sample count (to tell whether dim 0 of the hidden state is it).
        precision: the training precision's autocast context (boundary dtypes follow it).
    """
    names = first_names(model)
    index = {id(b): i for i, b in enumerate(blocks)}
    owner = {names[id(p)]: i for i, b in enumerate(blocks) for p in b.parameters()}
    n = len(blocks)
    state: dict[str, Any] = {"place": PRE, "tuple": False, "previous": None, "batch_major": True}
    unchained: list[int] = []
    boundary: list[tuple[tuple[int, ...], torch.dtype]] = [((), torch.float32)] * (n + 1)
    seen: dict[str, set[str]] = {}

    def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        i = index[id(module)]
        state["place"] = f"block:{i}"
        try:
            hidden = hidden_of(args, kwargs)
        except BlockInputError as exc:
            state["error"] = state.get("error") or str(exc)
            return
        boundary[i] = (tuple(hidden.shape[1:]), hidden.dtype)
        state["batch_major"] = state["batch_major"] and hidden.dim() > 0 and hidden.shape[0] == batch
        if i > 0 and hidden is not state["previous"]:
            unchained.append(i)

    def after(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        i = index[id(module)]
        state["place"] = POST if i == n - 1 else f"between:{i}"
        hidden = out[0] if isinstance(out, tuple) else out
        state["previous"] = hidden
        if i == n - 1:
            state["tuple"] = isinstance(out, tuple)
            boundary[n] = (tuple(hidden.shape[1:]), hidden.dtype)

    handles = [h for b in blocks for h in (b.register_forward_pre_hook(before, with_kwargs=True),
                                           b.register_forward_hook(after, with_kwargs=True))]
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda), precision(), \
                _Recorder(names, seen, lambda: state["place"]):
            forward()
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for name, value in model.named_buffers():
                value.copy_(buffers[name])
    return ModelUsage({k: frozenset(v) for k, v in seen.items()}, owner, tuple(boundary), bool(state["tuple"]),
                      tuple(unchained), bool(state["batch_major"]), state.get("error"))
