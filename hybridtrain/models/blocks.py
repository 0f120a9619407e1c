"""Finding the repeated blocks of any model: the unit that checkpointing, offload,
streaming and pipeline partitioning work on."""

from __future__ import annotations

from torch import nn


class BlocksNotFoundError(ValueError):
    """The model has no recognisable list of repeated blocks."""


def find_blocks(model: nn.Module, path: str | None = None) -> tuple[str, nn.ModuleList | nn.Sequential]:
    """Return ``(dotted_path, container)`` of the model's repeated blocks.

    With ``path`` the container is looked up; without, an ``nn.Sequential`` model is its
    own container, otherwise the ``ModuleList`` of at least two same-class modules holding
    the most parameters is chosen (``transformer.h`` of GPT-2, ``model.layers`` of Llama).

    Raises:
        BlocksNotFoundError: the path does not exist / is not a list, or nothing was found.
    """
    if path:
        try:
            container = model.get_submodule(path)
        except AttributeError:
            raise BlocksNotFoundError(
                f"model.blocks = {path!r} does not exist in {type(model).__name__}; "
                f"candidates: {_candidates(model) or 'none'}"
            ) from None
        if not isinstance(container, nn.ModuleList | nn.Sequential):
            raise BlocksNotFoundError(
                f"model.blocks = {path!r} is a {type(container).__name__}, not a ModuleList or Sequential"
            )
        return path, container
    if isinstance(model, nn.Sequential):
        return "", model
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and _is_repeated(module):
            size = sum(p.numel() for p in module.parameters())
            if best is None or size > best[0]:
                best = (size, name, module)
    if best is None:
        raise BlocksNotFoundError(
            f"could not find the repeated blocks of {type(model).__name__}; set model.blocks to "
            "the dotted path of its ModuleList of blocks"
        )
    return best[1], best[2]


def _is_repeated(container: nn.ModuleList) -> bool:
    kinds = {type(m) for m in container}
    return len(container) >= 2 and len(kinds) == 1


def _candidates(model: nn.Module) -> str:
    return ", ".join(
        name for name, m in model.named_modules() if isinstance(m, nn.ModuleList | nn.Sequential) and name
    )
