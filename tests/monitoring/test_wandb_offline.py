"""W&B with the real ``wandb`` package in offline mode: a ``hybridtrain train`` run's config,
name (the training service's job name) and every step's metrics are in the run W&B wrote
locally, and a resumed run continues the same W&B run; read back from its ``run-*.wandb`` files
(``wandb sync`` uploads them later; the W&B API is not available offline)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from hybridtrain.config import load_config
from hybridtrain.trainer import run_training

wandb = pytest.importorskip("wandb", reason="wandb is not installed (pip install 'hybridtrain[tracking]')")
pytestmark = pytest.mark.timeout(120)

#: W&B's transaction-log framing (LevelDB's log format): a 7-byte file header (":W&B", magic,
#: version), then 32 KiB blocks of records, each a 7-byte header (CRC-32C, length, kind) and a
#: protobuf ``Record`` (whole, or split into first/middle/last pieces across blocks).
HEADER, BLOCK, RECORD_HEADER, WHOLE, LAST = 7, 32 * 1024, 7, 1, 4


def wandb_records(path: Path, timeout: float = 20.0) -> list[Any]:
    """The protobuf records of a ``run-*.wandb`` file, once it holds the run's ``exit`` record (W&B
    writes the file from a process of its own, which may still be flushing when ``finish`` returns)."""
    deadline = time.monotonic() + timeout
    while True:
        records = _read_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def _read_records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records, pending, pos = [], b"", HEADER
    while pos + RECORD_HEADER <= len(data):
        if BLOCK - pos % BLOCK < RECORD_HEADER:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + RECORD_HEADER:pos + RECORD_HEADER + length]
        pos += RECORD_HEADER + length
        if kind in (WHOLE, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_a_run_is_logged_offline_with_its_config_and_metrics(tiny: dict[str, Any],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("HYBRIDTRAIN_JOB_NAME", "job-7")  # as the training service starts a job
    run_training(load_config({**tiny, "wandb": {"enabled": True, "project": "p", "group": "g"}}), progress=False)
    out = Path(tiny["train"]["output_dir"])
    [run_file] = out.glob("wandb/offline-run-*/run-*.wandb")
    records = wandb_records(run_file)
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.display_name, run.project, run.run_group) == ("job-7", "p", "g")
    config = {item.key: json.loads(item.value_json) for r in records if r.WhichOneof("record_type") == "config"
              for item in r.config.update} | {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["train"]["steps"] == 6 and config["model"]["name"] == "gpt-tiny"
    history: dict[int, dict[str, Any]] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            history.setdefault(r.history.step.num, {}).update(row)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for field in ("loss", "lr", "eval_loss"):
        expected = [(r["step"], r[field]) for r in rows if field in r]
        logged = [(step, row[f"hybridtrain/{field}"]) for step, row in sorted(history.items())
                  if f"hybridtrain/{field}" in row]
        assert logged == expected and expected, field
    assert history[6]["Train/Samples/train_loss"] == history[6]["hybridtrain/loss"] and history[6]["samples"] == 24
    # Resume to step 8: the same W&B run (its id), steps 7 and 8 logged into it.
    cfg = load_config({**tiny, "train": {**tiny["train"], "steps": 8},
                       "wandb": {"enabled": True, "project": "p", "group": "g"}})
    time.sleep(1.1)  # W&B names an offline run's directory by the second it starts: not the first run's
    run_training(cfg, resume=True, progress=False)
    [resumed_file] = set(out.glob("wandb/offline-run-*/run-*.wandb")) - {run_file}
    assert resumed_file.name == run_file.name  # run-<id>.wandb: the same run id
    resumed = [r.history for r in wandb_records(resumed_file) if r.WhichOneof("record_type") == "history"]
    assert [h.step.num for h in resumed] == [7, 8]
