"""A caller's optimizer when the engine replaces the model's parameters (ZeRO over several
processes, tensor parallel): DeepSpeed wraps the caller's optimizer whatever the stage, and
every framework hands it one (the Trainer's AdamW, Accelerate's, Lightning's
``configure_optimizers``), while hybridtrain builds its optimizer after sharding.

So the caller's optimizer is described — its class, its hyperparameters and its parameter
groups by parameter name — and rebuilt over the sharded parameters: the engine builds the
class with its settings, then the caller's groups are laid over it by name. What cannot be
rebuilt with the same math is refused in one line.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hybridtrain.config import Config, ConfigError


@dataclass(frozen=True)
class OptimizerSpec:
    """A caller's optimizer, without its parameter objects."""

    type: str
    """The config's ``optimizer.type`` that builds the same class (DeepSpeed's name rules)."""
    params: dict[str, Any]
    """The config's ``optimizer.params``: the class's defaults."""
    groups: list[tuple[dict[str, Any], list[str]]]
    """Each group's own settings and the names of its parameters."""


def describe(optimizer: torch.optim.Optimizer, model: nn.Module) -> OptimizerSpec:
    """What rebuilds ``optimizer`` over ``model``'s parameters once they are replaced.

    Raises:
        ConfigError: it has stepped already, is not a ``torch.optim`` class (or DeepSpeed's
            Adam), or holds parameters that are not the model's.
    """
    cls = type(optimizer)
    what = f"the optimizer given to deepspeed.initialize ({cls.__name__})"
    if optimizer.state:
        raise ConfigError(f"{what} has stepped already; under ZeRO over several processes hybridtrain rebuilds it "
                          "over the sharded parameters, so give it fresh")
    settings = sorted(optimizer.defaults)
    if getattr(torch.optim, cls.__name__, None) is cls:
        built: type[torch.optim.Optimizer] = cls
    elif isinstance(optimizer, torch.optim.Adam):  # DeepSpeedCPUAdam, FusedAdam: torch's Adam underneath
        built = torch.optim.Adam
    else:
        raise ConfigError(f"{what}: under ZeRO over several processes or tensor parallel hybridtrain rebuilds the "
                          "optimizer over the sharded parameters, which it can only for torch.optim classes; "
                          "give the config an optimizer section instead")
    # The defaults the class's constructor takes (AdamW's include one it sets itself).
    accepted = inspect.signature(built.__init__).parameters
    params = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    type_name = built.__name__
    if built is torch.optim.Adam:
        params["adam_w_mode"] = False  # torch's Adam (DeepSpeed's config "Adam" means AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        unknown = [p for p in group["params"] if id(p) not in names]
        if unknown:
            raise ConfigError(f"{what} holds {len(unknown)} parameters that are not the model's; under ZeRO over "
                              "several processes it is rebuilt over the model's sharded parameters")
        own = {k: group[k] for k in settings if k in group and group[k] != optimizer.defaults[k]}
        groups.append((own, [names[id(p)] for p in group["params"]]))
    if all(own == groups[0][0] for own, _ in groups):  # one setting for all: the class's settings
        params.update(groups[0][0])
        groups = [({}, group_names) for _, group_names in groups]
    return OptimizerSpec(type_name, params, groups)


def with_optimizer(cfg: Config, spec: OptimizerSpec, extra: dict[str, Any] | None = None) -> Config:
    """``cfg`` whose optimizer section builds ``spec``'s class with its settings (and ``extra``
    build options, such as the fp16 wrapper's zero-gradient step the caller's optimizer gets)."""
    section = cfg.optimizer.model_copy(update={"type": spec.type, "params": {**spec.params, **(extra or {})}})
    return cfg.model_copy(update={"optimizer": section})


def lay_groups(optimizer: torch.optim.Optimizer, model: nn.Module, spec: OptimizerSpec) -> bool:
    """Give the freshly built ``optimizer`` (over all of ``model``'s parameters, one group)
    the caller's groups, matched by parameter name.

    Returns:
        Whether the groups changed (a schedule built over the one group must be rebuilt).

    Raises:
        ConfigError: the engine's optimizer keeps its own copies of the parameters (optimizer
            offload) and the caller's groups differ from one plain group.
    """
    whole = {name for name, p in model.named_parameters() if p.requires_grad}
    listed = [name for _, names in spec.groups for name in names]
    if all(not own for own, _ in spec.groups) and len(listed) == len(whole) and set(listed) == whole:
        return False  # the class's settings over every trainable parameter: as built
    named = dict(model.named_parameters())
    built = [p for group in optimizer.param_groups for p in group["params"]]
    if len(optimizer.param_groups) != 1 or {id(p) for p in built} != {id(named[n]) for n in whole}:
        raise ConfigError("the optimizer given to deepspeed.initialize has parameter groups of their own "
                          f"({len(spec.groups)}) and this run keeps the optimizer's state apart from the model "
                          "(optimizer offload): give the groups the same settings, or train without offload")
    # The class's settings, not what the config's schedule already set (its first rate).
    base = {k: spec.params.get(k, v) for k, v in optimizer.param_groups[0].items() if k != "params"}
    optimizer.param_groups = [{**base, **own, "params": [named[n] for n in names]} for own, names in spec.groups]
    return True
