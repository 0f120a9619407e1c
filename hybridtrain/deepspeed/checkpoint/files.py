"""DeepSpeed's checkpoint files: their names, and reading them without running their code.

A DeepSpeed checkpoint ``save_dir/`` holds ``latest`` (the newest tag) and, per tag,
``mp_rank_00_model_states.pt`` (the module's state dict, the scheduler, the counters, the
caller's client state; under ZeRO-1/2 the parameter names and shapes of each optimizer
group, ``param_shapes``) and, under ZeRO, one ``zero_pp_rank_R_mp_rank_00_optim_states.pt``
per data-parallel rank (``bf16_`` before it when bf16 trained) holding that rank's slice of
the flat fp32 master weights and optimizer state. The recovery script ``zero_to_fp32.py``
lies beside the tags.

DeepSpeed reads these with plain ``torch.load``. Here they are read with torch's
``weights_only`` unpickler: tensors, containers and primitives, plus the three small
DeepSpeed classes these files name (a loss scaler's settings, the ZeRO stage enum, a
fragment's start and size), resolved to plain stand-ins defined below and never imported
from DeepSpeed. Anything else in a file is refused before it is called.
"""

from __future__ import annotations

import enum
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

LATEST = "latest"
MODEL_STATES = "mp_rank_00_model_states.pt"
RECOVERY_SCRIPT = "zero_to_fp32.py"
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
DS_VERSION_WRITTEN = "0.19.8"
"""The DeepSpeed release whose layout is written (its loader checks the version is set)."""


class ZeroStage(int, enum.Enum):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum`` (an int enum)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class LossScalerSettings:
    """Stand-in for DeepSpeed's ``LossScaler``/``DynamicLossScaler``: their attributes
    (``cur_scale``, ``dynamic`` …) as read, no behaviour."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


@dataclass
class FragmentAddress:
    """Stand-in for ``deepspeed.utils.tensor_fragment.fragment_address``."""

    numel: int
    start: int


def _enum_member(cls: Any, name: str) -> ZeroStage:
    """Stand-in for the ``getattr(ZeroStageEnum, "optimizer_states")`` that pickling an enum
    member by name writes (protocol 2, as DeepSpeed saves on some builds): the member of
    :class:`ZeroStage` only, never another object's attribute."""
    if cls is not ZeroStage or name not in ZeroStage.__members__:
        raise pickle.UnpicklingError(f"getattr({getattr(cls, '__name__', cls)!r}, {name!r}) is not a ZeRO stage")
    return ZeroStage[name]


_STAND_INS: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
    (ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_enum_member, "__builtin__.getattr"),
    (_enum_member, "builtins.getattr"),
    (LossScalerSettings, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (LossScalerSettings, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]


class StaticLossScaler:
    """What the drop-in writes where DeepSpeed's files hold its static ``LossScaler`` (ZeRO-3's
    optimizer files; the real DeepSpeed's loader takes the object as its scaler): pickled under
    DeepSpeed's class name by :func:`write_atomically`, with the attributes it has."""

    def __init__(self, scale: float = 1.0) -> None:
        self.cur_scale = scale
        self.dynamic = False


class DynamicLossScalerState:
    """What the drop-in writes where ZeRO-1/2 fp16 files hold DeepSpeed's ``DynamicLossScaler``
    (its loader takes the object as its scaler, so an fp16 run resumes with its scale):
    pickled under DeepSpeed's class name, with that class's attributes."""

    def __init__(self, state: dict[str, Any], window: int, min_scale: float, hysteresis: int,
                 consecutive_hysteresis: bool) -> None:
        self.cur_scale = float(state["cur_scale"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.scale_factor = 2.0
        self.scale_window = window
        self.min_scale = min_scale
        self.delayed_shift = hysteresis
        self.cur_hysteresis = int(state["cur_hysteresis"])
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = True
        self.dynamic = True
        self.dtype = torch.float16


# Classes written under DeepSpeed's own names (the reader maps those names to its stand-ins).
_WRITTEN_AS: dict[type, tuple[str, str]] = {
    StaticLossScaler: ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    DynamicLossScalerState: ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
}


# The pure-Python pickler: the C one offers no way to write a class under another name.
_PythonPickler: Any = pickle._Pickler


class _DeepSpeedNamesPickler(_PythonPickler):
    """Python's pickler, writing the classes of :data:`_WRITTEN_AS` as references to DeepSpeed's
    (which need not be importable here: the standard pickler would check that they are)."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        written = _WRITTEN_AS.get(obj)
        if written is None:
            super().save_global(obj, name)
            return
        self.write(pickle.GLOBAL + f"{written[0]}\n{written[1]}\n".encode())
        self.memoize(obj)


class _DeepSpeedNamesPickle:
    """The ``pickle_module`` :func:`torch.save` writes DeepSpeed's files with."""

    Pickler = _DeepSpeedNamesPickler


class UnreadableDeepSpeedFile(ValueError):
    """A DeepSpeed checkpoint file that is missing, or holds something a checkpoint does not."""


def read(path: str | os.PathLike[str]) -> dict[str, Any]:
    """One DeepSpeed ``.pt`` file as a dict (CPU tensors), read with torch's ``weights_only``
    unpickler and the stand-ins above.

    Raises:
        UnreadableDeepSpeedFile: missing, not a dict, or naming a class outside the allowlist.
    """
    if not Path(path).is_file():
        raise UnreadableDeepSpeedFile(f"DeepSpeed checkpoint file {path} is missing")
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            found = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError) as exc:
        raise UnreadableDeepSpeedFile(f"{path} is not plain checkpoint data: "
                                      f"{' '.join(str(exc).split())[:200]}") from None
    if not isinstance(found, dict):
        raise UnreadableDeepSpeedFile(f"{path} holds a {type(found).__name__}, not a DeepSpeed checkpoint dict")
    return found


def optim_states_name(dp_rank: int, bf16: bool) -> str:
    """The ZeRO optimizer file of data-parallel rank ``dp_rank``."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_00_optim_states.pt"


def optim_states_path(tag_dir: Path, dp_rank: int) -> Path | None:
    """Rank ``dp_rank``'s ZeRO optimizer file in ``tag_dir`` (either naming), None if absent."""
    for bf16 in (False, True):
        path = tag_dir / optim_states_name(dp_rank, bf16)
        if path.is_file():
            return path
    return None


def resolve_tag(checkpoint_dir: str | os.PathLike[str], tag: Any = None) -> Path | None:
    """``checkpoint_dir/tag``, the tag read from ``checkpoint_dir/latest`` when None; None
    when there is neither."""
    root = Path(checkpoint_dir)
    if tag is None:
        latest = root / LATEST
        if not latest.is_file():
            return None
        tag = latest.read_text().strip()
    return root / str(tag)


def is_deepspeed_layout(tag_dir: Path) -> bool:
    """Whether ``tag_dir`` holds DeepSpeed's files (its model-states file; rank 0's under ZeRO-3)."""
    return (tag_dir / MODEL_STATES).is_file() or (tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt").is_file()


def write_atomically(state: Any, path: Path) -> None:
    """``torch.save`` to a temporary name, then rename: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(state, tmp, pickle_module=_DeepSpeedNamesPickle)
    tmp.replace(path)
