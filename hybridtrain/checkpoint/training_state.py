"""The engine's training state as a flat, layout-free checkpoint state, and back.

Keys (every tensor in its full logical shape; DCP stores a DTensor as its shards)::

    model.<name>           a model state-dict entry, saved by the rank that owns it
    optim.<param>.<key>    a parameter's optimizer state (exp_avg, step …), by parameter NAME;
                           ``master``: its fp32 master when the optimizer keeps one (:class:`KeepsMasters`)
    engine                 rank 0: optimizer hyperparameters per group, scheduler, loss
                           scaler, counters, the caller's client_state (a pickled blob)
    rng.<rank>             each rank's RNG states (a pickled blob)
    names.<rank>           what that rank recorded about names (:class:`SavedNames`): other
                           names of the parameters it saved (tied weights are saved once,
                           under the first name the saving rank knew), and the entries it
                           saved in tensor parallel's interleaved fused-qkv row order

Every rank saves its tensors as they are — no gather, no conversion. Nothing in a key or
shape depends on the saving layout, so any layout loads it: the loading rank points DCP
at its own tensors (in its own sharding) and DCP reads the slices they cover. The one
exception is a fused qkv entry whose row order differs between the saving and loading
runs (another tensor-parallel degree): it is read whole and its rows put in this run's order.

RNG across world sizes: rank ``r`` restores the generator states saved by rank
``r % old_world_size``. With the same world size that is exact; otherwise ranks that
drew identical numbers before (the usual case: every rank seeds alike) still do, and a
resumed run that depends on per-rank random streams (dropout on different data shards)
continues with a valid but different stream than an uninterrupted run on the new size
would have — such a run can never be "the same run" on another world size.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from hybridtrain.checkpoint import legacy, sharded
from hybridtrain.checkpoint.layout import CheckpointError, read_meta
from hybridtrain.optim import Scheduler
from hybridtrain.parallel.gradient_sync import local
from hybridtrain.parallel.runtime import ParallelRuntime
from hybridtrain.parallel.tensor import qkv_to_user
from hybridtrain.runtime import device as dev
from hybridtrain.runtime.offload import OffloadOptimizer
from hybridtrain.runtime.precision import LossScaler

MODEL, OPTIM, ENGINE, RNG, NAMES = "model.", "optim.", "engine", "rng.", "names."
MASTER = "master"
"""The optimizer entry holding a parameter's fp32 master (:class:`KeepsMasters`)."""
LAYOUT_SETTINGS = frozenset({"optimizer_state"})
"""Settings of a run's fingerprint that only described how format 1 keyed the optimizer
state; format 2 reads any layout, so they are not compared."""


class KeepsMasters(Protocol):
    """An optimizer whose parameters are fp32 masters of the model's half parameters, with a
    loss scale of its own (the DeepSpeed drop-in's bf16/fp16 wrapper): each master is saved as
    the ``master`` entry of the parameter it updates, its precision state in the engine entry."""

    def master_sources(self) -> dict[int, nn.Parameter]:
        """``id(master)`` → the model parameter it updates."""

    def precision_state_dict(self) -> dict[str, Any]:
        """What besides the masters a resume needs (the loss scale)."""

    def load_precision_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`precision_state_dict`'s state."""


def _masters_of(optimizer: torch.optim.Optimizer) -> KeepsMasters | None:
    sources = getattr(optimizer, "master_sources", None)
    return optimizer if callable(sources) else None  # type: ignore[return-value]


@dataclass
class TrainingParts:
    """What a checkpoint saves and restores (the engine's parts)."""

    parallel: ParallelRuntime
    optimizer: torch.optim.Optimizer
    scheduler: Scheduler | None = None
    scaler: LossScaler | None = None


@dataclass
class Restored:
    """What a load gives back to the engine."""

    counters: dict[str, int] = field(default_factory=dict)
    client_state: dict[str, Any] = field(default_factory=dict)


def save(path: str | Path, parts: TrainingParts, counters: dict[str, int], client_state: dict[str, Any],
         meta: dict[str, Any], async_save: bool = False) -> Path:
    """Save the training state as the checkpoint ``path`` (every rank calls it).

    Args:
        counters: the engine's step counters (restored by :func:`load`).
        client_state: the caller's state (data position …), returned by :func:`load`.
        meta: ``meta.json`` fields (step, parameter shapes, setup).
        async_save: write in the background (see :mod:`hybridtrain.checkpoint.sharded`).
    """
    rank, world = sharded.rank_and_world()
    state = _collect(parts, rank)
    if rank == 0:
        state[ENGINE] = _blob({
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in parts.optimizer.param_groups],
            "scheduler": parts.scheduler.state_dict() if parts.scheduler else None,
            "scaler": parts.scaler.state_dict() if parts.scaler else None,
            "precision": keeper.precision_state_dict() if (keeper := _masters_of(parts.optimizer)) else None,
            "counters": counters, "client_state": client_state,
        })
    full_meta = {**meta, "world_size": world, "topology": parts.parallel.topology.describe(),
                 "optimizer_groups": len(parts.optimizer.param_groups)}
    return sharded.save(Path(path), state, lambda: full_meta, async_save=async_save)


def load(path: str | Path, parts: TrainingParts, check: Callable[[Path, dict[str, Any]], None],
         model_only: bool = False) -> Restored:
    """Restore the checkpoint ``path`` into ``parts`` on every rank, whatever layout saved it.

    Args:
        check: called with the path and ``meta.json`` before anything is read; raises
            :class:`CheckpointError` when the checkpoint does not fit the run.
        model_only: restore the model's weights (and return the client state) only.

    Raises:
        CheckpointError: missing, not a checkpoint, or rejected by ``check``.
        IncompleteCheckpointError: incomplete or corrupt (an older checkpoint may serve);
            nothing is modified then.
    """
    sharded.wait_for_pending()
    found, meta = read_meta(path)
    check(found, meta)
    if meta["format"] == 1:
        return _load_format_1(found, meta, parts, model_only)
    sharded.verify(found, meta)
    stored = sharded.storage_metadata(found)
    rank, _ = sharded.rank_and_world()
    old_world = int(meta["world_size"])
    groups = len(parts.optimizer.param_groups)
    if not model_only and int(meta.get("optimizer_groups", groups)) != groups:
        raise CheckpointError(f"checkpoint {found} has {meta['optimizer_groups']} optimizer parameter groups, "
                              f"this run's optimizer {groups}")
    targets: dict[str, Any] = {ENGINE: b"", f"{RNG}{rank % old_world}": b""}
    names = saved_names(found, stored)
    model_later = _model_targets(parts.parallel, stored, targets, names)
    optim_later = {} if model_only else _optimizer_targets(parts, stored, targets, names)
    sharded.load(found, targets)
    with torch.no_grad():
        for live, deferred in model_later:
            local(live).copy_(local(deferred.convert(parts.parallel)))
    engine = _unblob(targets[ENGINE])
    if model_only:
        return Restored(client_state=engine["client_state"])
    _restore_optimizer(parts, optim_later, targets, engine["param_groups"])
    if parts.scheduler is not None and engine["scheduler"] is not None:
        parts.scheduler.load_state_dict(engine["scheduler"])
    if parts.scaler is not None and engine["scaler"] is not None:
        parts.scaler.load_state_dict(engine["scaler"])
    keeper = _masters_of(parts.optimizer)
    if keeper is not None and engine.get("precision") is not None:
        keeper.load_precision_state_dict(engine["precision"])
    dev.set_rng_state(_unblob(targets[f"{RNG}{rank % old_world}"]))
    return Restored(engine["counters"], engine["client_state"])


def optimizer_param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """For each of the optimizer's parameters (in ``state_dict`` index order), every name it
    has in ``model`` (model order). Host masters of optimizer offload count as the device
    parameters they update.

    Raises:
        CheckpointError: a parameter the model does not have.
    """
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    source: dict[int, nn.Parameter] = {}
    if isinstance(optimizer, OffloadOptimizer):
        source = {id(m): p for b in optimizer.buckets for p, m in zip(b.params, b.masters, strict=True)}
    elif (keeper := _masters_of(optimizer)) is not None:
        source = keeper.master_sources()
    out = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            found = names.get(id(source.get(id(param), param)))
            if found is None:
                raise CheckpointError(f"the optimizer updates a tensor of shape {list(param.shape)} that is not a "
                                      "parameter of the model; checkpoints key optimizer state by parameter name")
            out.append(found)
    return out


# ----------------------------------------------------------------------------- saving
def _collect(parts: TrainingParts, rank: int) -> dict[str, Any]:
    """This rank's flat state: its tensors as they are (DTensor shards stay shards)."""
    runtime, optimizer = parts.parallel, parts.optimizer
    state: dict[str, Any] = {}
    names = SavedNames()
    for name, value in runtime.model.state_dict().items():
        if runtime.owns(name):
            state[MODEL + name] = value
            names.note_interleave(name, runtime.row_interleave(name))
    params = [p for g in optimizer.param_groups for p in g["params"]]
    keeps_masters = _masters_of(optimizer) is not None
    for param, aliases in zip(params, optimizer_param_names(runtime.model, optimizer), strict=True):
        owned = [n for n in aliases if runtime.owns(n)]
        if not owned:
            continue  # another pipeline stage saves it
        canonical = owned[0]
        names.aliases.update({n: canonical for n in aliases if n != canonical})
        names.note_interleave(canonical, runtime.row_interleave(canonical))
        for key, value in optimizer.state.get(param, {}).items():
            state[f"{OPTIM}{canonical}.{key}"] = value
        if keeps_masters:
            state[f"{OPTIM}{canonical}.{MASTER}"] = param
    if names.aliases or names.interleave:
        state[f"{NAMES}{rank}"] = _blob({"aliases": names.aliases, "interleave": names.interleave})
    state[f"{RNG}{rank}"] = _blob(dev.get_rng_state())
    return state


@dataclass
class SavedNames:
    """What the saving ranks recorded about names: ``aliases`` (another name of a parameter
    → the name its optimizer state is saved under) and ``interleave`` (entries saved in
    tensor parallel's interleaved fused-qkv row order → over how many ranks; absent = the
    user's ``[Q; K; V]`` order)."""

    aliases: dict[str, str] = field(default_factory=dict)
    interleave: dict[str, int] = field(default_factory=dict)

    def note_interleave(self, name: str, size: int) -> None:
        """Record ``name``'s row interleave (only when it is not the user's order)."""
        if size > 1:
            self.interleave[name] = size


# ----------------------------------------------------------------------------- loading
def saved_names(path: Path, stored: Metadata) -> SavedNames:
    """Every saving rank's :class:`SavedNames`, merged (read first: they decide what to ask for)."""
    keys: dict[str, Any] = {k: b"" for k in stored.state_dict_metadata if k.startswith(NAMES)}
    merged = SavedNames()
    if keys:
        sharded.load(path, keys)
    for blob in keys.values():
        saved = _unblob(blob)
        merged.aliases.update(saved["aliases"])
        merged.interleave.update(saved["interleave"])
    return merged


@dataclass
class _Deferred:
    """A stored tensor read whole, to be put into this rank's layout after the read."""

    name: str
    buffer: torch.Tensor
    like: torch.Tensor
    stored_interleave: int

    def convert(self, runtime: ParallelRuntime) -> torch.Tensor:
        full = self.buffer
        if self.stored_interleave > 1:
            full = qkv_to_user(full, self.stored_interleave)
        return runtime.from_user_layout(self.name, full, self.like)


def _target(runtime: ParallelRuntime, name: str, like: torch.Tensor, md: TensorStorageMetadata,
            stored: int, in_place: bool) -> tuple[torch.Tensor, _Deferred | None]:
    """What DCP reads the stored entry of ``name`` into: a tensor in ``like``'s own layout
    (``like`` itself when ``in_place``) when the row orders agree — DCP then reads just this
    rank's slices — else a whole buffer converted after the read (a change of
    tensor-parallel degree for a fused qkv entry; ``stored`` is the saved row interleave)."""
    if stored == runtime.row_interleave(name):
        return (like if in_place else torch.empty_like(like, dtype=md.properties.dtype, requires_grad=False)), None
    buffer = torch.empty(md.size, dtype=md.properties.dtype)
    return buffer, _Deferred(name, buffer, like, stored)


def _model_targets(runtime: ParallelRuntime, stored: Metadata, targets: dict[str, Any],
                   names: SavedNames) -> list[tuple[torch.Tensor, _Deferred]]:
    """Point DCP at the live model tensors (read in place), or at whole buffers for the
    entries to convert (returned with their live tensor)."""
    later = []
    for name, live in runtime.model.state_dict().items():
        md = stored.state_dict_metadata.get(MODEL + name)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint has no model entry {name!r}")
        targets[MODEL + name], deferred = _target(runtime, name, live, md, names.interleave.get(name, 1),
                                                  in_place=True)
        if deferred is not None:
            later.append((live, deferred))
    return later


_OptimTargets = dict[int, dict[str, tuple[str, _Deferred | None]]]


def _optimizer_targets(parts: TrainingParts, stored: Metadata, targets: dict[str, Any],
                       names: SavedNames) -> _OptimTargets:
    """Buffers for every stored optimizer entry of this rank's parameters, in this rank's
    sharding (returned: parameter index → state key → (target key, conversion if any))."""
    by_name: dict[str, dict[str, Any]] = {}
    for key, md in stored.state_dict_metadata.items():
        if key.startswith(OPTIM):
            name, entry = key[len(OPTIM):].rsplit(".", 1)
            by_name.setdefault(name, {})[entry] = md
    runtime, optimizer = parts.parallel, parts.optimizer
    params = [p for g in optimizer.param_groups for p in g["params"]]
    later: _OptimTargets = {}
    for index, (param, aliases) in enumerate(zip(params, optimizer_param_names(runtime.model, optimizer),
                                                 strict=True)):
        saved = next((names.aliases.get(n, n) for n in aliases if names.aliases.get(n, n) in by_name), None)
        if saved is None:
            continue  # never stepped when saved (no gradient yet)
        later[index] = {}
        for entry, md in by_name[saved].items():
            key = f"{OPTIM}{saved}.{entry}"
            deferred = None
            if isinstance(md, BytesStorageMetadata):
                targets[key] = b""
            elif len(md.size) > 0 and md.size == param.shape:  # shaped like the parameter
                targets[key], deferred = _target(runtime, aliases[0], param, md, names.interleave.get(saved, 1),
                                                 in_place=False)
            else:  # a scalar such as Adam's step
                targets[key] = torch.empty(md.size, dtype=md.properties.dtype)
            later[index][entry] = (key, deferred)
    return later


def _restore_optimizer(parts: TrainingParts, later: _OptimTargets, targets: dict[str, Any],
                       groups: list[dict[str, Any]]) -> None:
    """Load the read entries into the optimizer by index (its own ``load_state_dict``: casts,
    device moves and the hooks of wrappers such as optimizer offload run as usual)."""
    state = {index: {entry: deferred.convert(parts.parallel) if deferred is not None else targets[key]
                     for entry, (key, deferred) in entries.items()}
             for index, entries in later.items()}
    current = parts.optimizer.state_dict()
    current["state"] = state
    current["param_groups"] = [{**mine, **saved, "params": mine["params"]}
                               for mine, saved in zip(current["param_groups"], groups, strict=True)]
    parts.optimizer.load_state_dict(current)


def _load_format_1(path: Path, meta: dict[str, Any], parts: TrainingParts, model_only: bool) -> Restored:
    files = legacy.read(path, meta)
    state = files["engine.pt"]
    parts.parallel.load_model_state_dict(files["model.pt"])
    if model_only:
        return Restored(client_state=state["client_state"])
    parts.parallel.load_optimizer_state_dict(parts.optimizer, state["optimizer"])
    if parts.scheduler is not None and state["scheduler"] is not None:
        parts.scheduler.load_state_dict(state["scheduler"])
    if parts.scaler is not None and state["scaler"] is not None:
        parts.scaler.load_state_dict(state["scaler"])
    dev.set_rng_state(state["rng"])
    counters = {"global_step": int(state["global_step"]), "nonfinite_skips": int(state["nonfinite_skips"])}
    return Restored(counters, state["client_state"])


def _blob(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _unblob(blob: Any) -> Any:
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
