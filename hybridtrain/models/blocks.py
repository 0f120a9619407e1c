"""Finding the repeated blocks of any model: the unit that checkpointing, offload,
streaming and pipeline partitioning work on.

Most models have one list of blocks (``transformer.h`` of GPT-2, ``model.layers`` of
Llama). Encoder–decoder models (T5, BART) and multi-tower models have several; every one
of them is found, in execution order, so that no tower is silently left out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

BlockList = nn.ModuleList | nn.Sequential

# A repeated list this much smaller than the largest one is a detail (a list of heads,
# of adapters), not a tower of blocks.
_TOWER_SHARE = 0.25


class BlocksNotFoundError(ValueError):
    """The model has no recognisable list of repeated blocks."""


def find_block_lists(model: nn.Module, paths: str | Sequence[str] | None = None) -> list[tuple[str, BlockList]]:
    """Return ``[(dotted_path, container), …]`` of the model's block lists, in the order the
    model creates them (encoder before decoder).

    With ``paths`` (one dotted path or a list of them) exactly those are looked up; without,
    an ``nn.Sequential`` model is its own container, otherwise the largest ``ModuleList`` of
    at least two same-class modules (or of a hybrid's composite layers) is taken together
    with every other such list that holds at least a quarter of its parameters and is not
    nested in a chosen one (T5's
    ``encoder.block`` and ``decoder.block``; a mixture-of-experts list inside each layer is
    nested and left out).

    Raises:
        BlocksNotFoundError: a path does not exist / is not a list, or nothing was found.
    """
    if paths:
        return [(path, _lookup(model, path)) for path in ([paths] if isinstance(paths, str) else paths)]
    if isinstance(model, nn.Sequential):
        return [("", model)]
    found = _lists(model, _is_repeated) or _lists(model, _is_layer_list)
    if not found:
        raise BlocksNotFoundError(
            f"could not find the repeated blocks of {type(model).__name__}; set model.blocks to "
            "the dotted path of its ModuleList of blocks (or a list of paths)"
        )
    largest = max(size for _, _, size in found)
    chosen: list[tuple[str, nn.ModuleList]] = []
    for name, module, size in sorted(found, key=lambda item: -item[2]):
        nested = any(_within(name, other) or _within(other, name) for other, _ in chosen)
        if size >= _TOWER_SHARE * largest and not nested:
            chosen.append((name, module))
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(chosen, key=lambda item: order[item[0]])


def find_blocks(model: nn.Module, path: str | Sequence[str] | None = None) -> tuple[str, BlockList]:
    """The model's single block list ``(dotted_path, container)``.

    Raises:
        BlocksNotFoundError: as :func:`find_block_lists`, or the model has several block
            lists (a technique that needs one ordered list, such as a pipeline, cannot split
            an encoder–decoder model).
    """
    lists = find_block_lists(model, path)
    if len(lists) > 1:
        raise BlocksNotFoundError(
            f"{type(model).__name__} has {len(lists)} block lists ({', '.join(p for p, _ in lists)}); "
            "this technique needs one, so set model.blocks to one of them"
        )
    return lists[0]


def block_names(lists: Sequence[tuple[str, BlockList]]) -> list[str]:
    """Dotted names of every block of ``lists``, in order (``""`` path: ``"0"``, ``"1"`` …)."""
    return [f"{path}.{i}" if path else str(i) for path, container in lists for i in range(len(container))]


def _lookup(model: nn.Module, path: str) -> BlockList:
    try:
        container = model.get_submodule(path)
    except AttributeError:
        raise BlocksNotFoundError(
            f"model.blocks = {path!r} does not exist in {type(model).__name__}; "
            f"candidates: {_candidates(model) or 'none'}"
        ) from None
    if not isinstance(container, BlockList):
        raise BlocksNotFoundError(
            f"model.blocks = {path!r} is a {type(container).__name__}, not a ModuleList or Sequential"
        )
    return container


def _within(name: str, parent: str) -> bool:
    return name.startswith(parent + ".")


def _lists(model: nn.Module, accept: Callable[[nn.ModuleList], bool]) -> list[tuple[str, nn.ModuleList, int]]:
    return [(name, module, sum(p.numel() for p in module.parameters()))
            for name, module in model.named_modules() if isinstance(module, nn.ModuleList) and accept(module)]


def _is_repeated(container: nn.ModuleList) -> bool:
    """At least two same-class modules, or a hybrid model's layers: layers (see
    :func:`_is_layer_list`) of a few classes that repeat (Jamba's state-space and attention
    layers) — not two different towers, nor parallel branches of one class each."""
    kinds = [type(m) for m in container]
    if len(kinds) < 2:
        return False
    if len(set(kinds)) == 1:
        return True
    # A parametrized module (weight norm) gets a class of its own: such a list never repeats.
    return len(set(kinds)) < len(kinds) and _is_layer_list(container)


def _is_layer_list(container: nn.ModuleList) -> bool:
    """At least two composite modules with parameters, none weight-normed: the fallback when
    no list repeats a class (a two-layer hybrid model has one layer of each class)."""
    return len(container) >= 2 and all(
        next(m.children(), None) is not None and next(m.parameters(), None) is not None
        and not hasattr(m, "parametrizations") for m in container)


def _candidates(model: nn.Module) -> str:
    return ", ".join(
        name for name, m in model.named_modules() if isinstance(m, nn.ModuleList | nn.Sequential) and name
    )
