"""The host⇄device link: a probe of pinned copies each way and both at once (the GPU check's
``part: link`` row), and the planner taking a measured or given link the way it takes the
host memory bandwidth (``--link-bandwidth``; measured for this machine's GPU; else the table)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import yaml

from hybridtrain.commands.cli import main
from hybridtrain.planner.estimate import (
    Target,
    estimate,
    hardware,
    link_bandwidth_source,
    resolve_target,
)
from hybridtrain.profiling.link_bandwidth import link_bandwidth

OFFLOAD = {"model": {"name": "gpt-tiny"}, "data": {"seq_len": 64}, "train_micro_batch_size_per_gpu": 4,
           "bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}


def test_probe_on_the_cpu_writes_every_field() -> None:
    found = link_bandwidth("cpu", nbytes=2**20, repeats=2)
    row = found.as_row()
    assert set(row) == {"h2d_gb_s", "d2h_gb_s", "bidir_gb_s", "bytes", "pinned"}
    assert row["pinned"] is False and row["bytes"] == 2**20
    assert all(row[k] > 0.01 for k in ("h2d_gb_s", "d2h_gb_s", "bidir_gb_s"))  # any DRAM copies > 10 MB/s


def test_probe_refuses_nothing_to_copy() -> None:
    with pytest.raises(ValueError, match="nbytes 0"):
        link_bandwidth("cpu", nbytes=0)


def test_flag_sets_the_link_the_plan_divides_by(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "offload.yaml"
    path.write_text(yaml.safe_dump(OFFLOAD))
    assert main(["estimate", str(path), "--device", "H100", "--link-bandwidth", "20GB/s", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["target"]["link_bandwidth"] == 20e9
    assert main(["estimate", str(path), "--device", "H100", "--link-bandwidth", "20GB/s"]) == 0
    assert "host<->device link: 20.0 GB/s each way (given)" in capsys.readouterr().out


def test_given_measured_and_table_links() -> None:
    assert link_bandwidth_source(resolve_target("H100")) == (
        50e9, "the H100 SXM table figure; --link-bandwidth for another machine")
    given = Target("cuda", "H100 SXM", 80 * 2**30, link_bandwidth=20e9)
    assert link_bandwidth_source(given) == (20e9, "given")
    assert hardware(given, None).links.host_to_device == 20e9
    slow, fast = (estimate(OFFLOAD, Target("cuda", "H100 SXM", 80 * 2**30, link_bandwidth=rate)).time
                  for rate in (1e9, 1e12))
    assert slow.transfers == pytest.approx(1000 * fast.transfers) and slow.transfers > 0  # the offload's copies


def test_this_machines_gpu_is_probed(monkeypatch: pytest.MonkeyPatch) -> None:
    module = importlib.import_module("hybridtrain.planner.estimate")
    monkeypatch.setattr(module.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(module, "probe_link_bandwidth", lambda: 53e9)
    assert link_bandwidth_source(Target("cuda", "H100 SXM", 80 * 2**30, local=True)) == (53e9, "measured here")
