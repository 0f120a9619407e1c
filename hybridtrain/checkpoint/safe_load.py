"""Reading a DCP checkpoint without running code from it.

torch's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle``,
and ``DefaultLoadPlanner.load_bytes`` reads every non-tensor entry with
``torch.load(weights_only=False)``: a crafted checkpoint (whose ``meta.json`` checksums
match, since whoever crafted it wrote those too) would run its code on ``--resume`` or
``checkpoint export``. Checksums catch accidents, not attackers, and users resume from
shared buckets. Both extension points are public and overridden here:

- :class:`SafeReader` reads ``.metadata`` with :class:`MetadataUnpickler`, which admits
  only the classes DCP's metadata is made of (its dataclasses and enums, ``torch.Size``,
  dtypes and layouts, paths); anything else is refused before it is called;
- :class:`SafePlanner` first reads each non-tensor entry with torch's ``weights_only``
  unpickler (tensors, containers, primitives), and only what passes it reaches DCP.

Tensor data itself is already read with ``weights_only=True`` by DCP.

Where the data is read from is checked too: ``.metadata`` maps every entry to a file by a
relative path (``_StorageInfo.relative_path``), which DCP joins to the checkpoint directory
as it stands. :class:`SafeReader` admits only plain regular files directly inside the
directory (:func:`hybridtrain.checkpoint.layout.plain_file_problem`: no absolute path, no
``..``, no symbolic link out, no FIFO or device, checked before anything is opened) and,
when the directory has a ``meta.json``, only files it lists (and so checksums).
"""

from __future__ import annotations

import enum
import io
import pickle
from pathlib import Path, PurePath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from hybridtrain.checkpoint.layout import listed_files, plain_file_problem
from hybridtrain.compat import dcp_storage_info

METADATA_FILE = ".metadata"

_METADATA_MODULES = {
    # Every dataclass and enum DCP's metadata is written with (and nothing else there).
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict"},
}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file names something outside what a checkpoint is made of."""


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the names DCP metadata uses (see the module
    docstring); any other global is an :class:`UnsafeCheckpointError`, raised before the
    name is imported or called."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_MODULES.get(module, ()):
            return super().find_class(module, name)
        if module == "builtins" and name == "getattr":
            return _enum_member  # how some torch builds pickle an enum member: getattr(cls, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype
                                                               | torch.layout | torch.memory_format)):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"{module}.{name} is not part of a checkpoint's metadata")


def _enum_member(cls: Any, name: str) -> enum.Enum:
    """``getattr(cls, name)`` only where ``cls`` is an enum the metadata may hold (resolved
    through :meth:`MetadataUnpickler.find_class` already) and ``name`` one of its members:
    never a method or another attribute."""
    admitted = isinstance(cls, type) and issubclass(cls, enum.Enum) and \
        cls.__name__ in _METADATA_MODULES.get(cls.__module__, ())
    if not admitted or not isinstance(name, str) or name not in cls.__members__:
        raise UnsafeCheckpointError(f"getattr({getattr(cls, '__name__', cls)!r}, {name!r}) is not part of a "
                                    "checkpoint's metadata")
    return cls.__members__[name]


def read_metadata_safely(path: str | Path, name: str = METADATA_FILE) -> dcp_metadata.Metadata:
    """The DCP metadata file ``name`` of checkpoint directory ``path``, read with
    :class:`MetadataUnpickler`.

    Raises:
        UnsafeCheckpointError: the file names a class a checkpoint does not hold.
        pickle.UnpicklingError / OSError / EOFError: unreadable.
    """
    problem = plain_file_problem(Path(path), name)
    if problem:
        raise UnsafeCheckpointError(f"{Path(path) / name} {problem}")
    with open(Path(path) / name, "rb") as fh:
        found = MetadataUnpickler(fh).load()
    if not isinstance(found, dcp_metadata.Metadata):
        raise UnsafeCheckpointError(f"{METADATA_FILE} holds a {type(found).__name__}, not checkpoint metadata")
    return found


def check_storage(path: Path, metadata: dcp_metadata.Metadata) -> None:
    """Refuse, in one line naming the entry and the path, metadata that maps an entry to
    anything but a plain file inside checkpoint ``path`` that its ``meta.json`` (if any) lists.

    Raises:
        UnsafeCheckpointError: the first such entry.
    """
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise UnsafeCheckpointError(f"{path / METADATA_FILE}: its storage map is a {type(storage).__name__}")
    listed = listed_files(path)
    for index, info in storage.items():
        entry = getattr(index, "fqn", index)
        if not isinstance(info, dcp_storage_info()):
            raise UnsafeCheckpointError(f"{path / METADATA_FILE}: entry {entry!r} has no file location")
        name = info.relative_path
        name = str(name) if isinstance(name, PurePath) else name
        problem = plain_file_problem(path, name)
        if problem is None and listed is not None and name not in listed:
            problem = "is not listed in meta.json (only listed files are checked and read)"
        if problem:
            raise UnsafeCheckpointError(f"{path / METADATA_FILE}: entry {entry!r} is stored in {name!r}, which "
                                        f"{problem}")


class SafeReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` runs no code from the file.

    ``*args, **kwargs``: torch 2.6 declares ``read_metadata()``, torch 2.7 and later
    (2.11, 2.13) ``read_metadata(*args, **kwargs)`` with an optional ``rank`` whose own
    ``__<rank>.metadata`` is read, as torch's reader does.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        found = read_metadata_safely(Path(self.path), METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}")
        check_storage(Path(self.path), found)  # before DCP plans a read from any file it names
        if getattr(found, "storage_meta", None) is None:
            found.storage_meta = dcp_metadata.StorageMeta()
        if found.storage_meta is not None and hasattr(self, "load_id"):
            found.storage_meta.load_id = self.load_id  # as torch's own reader does
        return found


class SafePlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor entries must pass torch's ``weights_only``
    unpickler before DCP reads them."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(f"checkpoint entry {read_item.dest_index.fqn!r} is not plain data: "
                                        f"{' '.join(str(exc).split())[:200]}") from None
        value.seek(0)
        super().load_bytes(read_item, value)
