"""Loading a checkpoint runs no code: a crafted checkpoint whose checksums and commit
marker are consistent (an attacker writes those too) plants a payload, and neither
``--resume`` nor ``checkpoint export`` runs it."""

from __future__ import annotations

import enum
import hashlib
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hybridtrain.checkpoint import sharded
from hybridtrain.checkpoint.layout import MARKER, META, CheckpointError
from hybridtrain.checkpoint.safe_load import read_metadata_safely
from hybridtrain.commands.cli import main
from hybridtrain.trainer import run_training
from tests.tiny_run import tiny_config


class Payload:
    """Unpickled with plain pickle, writes ``marker``: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return exec, (f"open({str(self.marker)!r}, 'w').write('code ran')",)


def recommit(path: Path) -> None:
    """Make ``meta.json`` and ``COMMITTED`` agree with the files as they are now."""
    meta = json.loads((path / META).read_text())
    for name in meta["files"]:
        data = (path / name).read_bytes()
        meta["files"][name] = [len(data), hashlib.sha256(data).hexdigest()]
    text = json.dumps(meta, indent=1, sort_keys=True)
    (path / META).write_text(text)
    (path / MARKER).write_text(json.dumps({"meta_sha256": hashlib.sha256(text.encode()).hexdigest()}))


def _plant_in_metadata(path: Path, marker: Path) -> None:
    """A valid ``.metadata`` that also carries the payload (plain pickle would run it and
    still return good metadata)."""
    with open(path / ".metadata", "rb") as fh:
        md = pickle.load(fh)  # our own file, written a moment ago by the test's run
    md.planner_data = Payload(marker)
    (path / ".metadata").write_bytes(pickle.dumps(md))
    recommit(path)


def test_neither_resume_nor_export_runs_a_payload_in_the_metadata(tmp_path: Path) -> None:
    run, marker = tmp_path / "run", tmp_path / "PWNED"
    cfg = tiny_config(run)
    run_training(cfg, progress=False)
    step = run / "checkpoints" / "step-0000001"
    _plant_in_metadata(step, marker)

    with pytest.raises(CheckpointError, match=r"no usable checkpoint .* builtins\.exec is not part of a "
                                              r"checkpoint's metadata"):
        run_training(cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 2})}), resume=True,
                     progress=False)
    assert main(["checkpoint", "export", str(step), str(tmp_path / "out")]) == 2
    assert not marker.exists()
    assert sorted(p.name for p in step.parent.iterdir()) == ["step-0000001"]  # refused, nothing pruned


def test_a_payload_in_a_non_tensor_entry_does_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    # A checkpoint's non-tensor entries are read back by DCP with torch.load(weights_only=False).
    dcp.save({"w": torch.ones(2), "blob": Payload(marker)}, storage_writer=dcp.FileSystemWriter(tmp_path / "ck"),
             no_dist=True)
    assert read_metadata_safely(tmp_path / "ck").state_dict_metadata.keys() == {"w", "blob"}
    with pytest.raises(CheckpointError, match=r"checkpoint entry 'blob' is not plain data"):
        sharded.load(tmp_path / "ck", {"w": torch.zeros(2), "blob": b""})
    assert not marker.exists()
    target: dict[str, Any] = {"w": torch.zeros(2)}
    sharded.load(tmp_path / "ck", target)  # the plain-data part still loads
    assert torch.equal(target["w"], torch.ones(2))


class _EnumByGetattr(pickle.Pickler):
    """Pickles enum members as ``getattr(cls, name)``, as torch's CUDA builds write DCP's
    ``_MEM_FORMAT_ENCODING`` (the 2.13.0+cu130 wheel; the CPU wheel pickles them by value)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def test_an_enum_member_pickled_by_getattr_loads_and_nothing_else_does(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "ok"))
    metadata = read_metadata_safely(tmp_path / "ok")
    buffer = tmp_path / "by_getattr"
    buffer.mkdir()
    with open(buffer / ".metadata", "wb") as fh:
        _EnumByGetattr(fh).dump(metadata)
    assert b"getattr" in (buffer / ".metadata").read_bytes()
    assert read_metadata_safely(buffer).state_dict_metadata.keys() == metadata.state_dict_metadata.keys()
    # getattr of anything but an admitted enum's member stays refused: Path.unlink would be a call away.
    evil = buffer.parent / "evil"
    evil.mkdir()
    (evil / ".metadata").write_bytes(b"\x80\x04cbuiltins\ngetattr\ncpathlib\nPath\nX\x06\x00\x00\x00unlink\x86R.")
    with pytest.raises(pickle.UnpicklingError, match="getattr\\('Path', 'unlink'\\) is not part"):
        read_metadata_safely(evil)
