"""The planner's host memory bandwidth: ``--host-bandwidth`` for another machine, a short
measured triad for this one, the GPU model's table figure otherwise; the host optimizer
step's predicted seconds follow it (28 bytes per offloaded parameter)."""

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
    host_bandwidth_source,
    resolve_target,
)
from hybridtrain.profiling.host_bandwidth import ADAM_BYTES_PER_PARAM, probe_host_bandwidth
from hybridtrain.units import parse_rate

OFFLOAD = {"model": {"name": "gpt-tiny"}, "data": {"seq_len": 64}, "train_micro_batch_size_per_gpu": 4,
           "bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}


@pytest.mark.parametrize(("text", "rate"), [("152GB/s", 152e9), ("25 GiB/s", 25 * 2**30), ("1.5e11", 1.5e11),
                                            ("800MB", 8e8), (3e9, 3e9)])
def test_rates_parse_with_units(text: str | float, rate: float) -> None:
    assert parse_rate(text) == rate


@pytest.mark.parametrize("text", ["fast", "0GB/s", "-5GB/s", "152GB/h", "inf"])
def test_bad_rates_are_one_line(text: str) -> None:
    with pytest.raises(ValueError, match=r"bandwidth; use a positive number of bytes per second") as info:
        parse_rate(text)
    assert "\n" not in str(info.value)


def test_flag_sets_the_host_step_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "offload.yaml"
    path.write_text(yaml.safe_dump(OFFLOAD))
    steps = {}
    for rate in ("25GB/s", "150GB/s"):
        assert main(["estimate", str(path), "--device", "H100", "--host-bandwidth", rate, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["target"]["host_bandwidth"] == parse_rate(rate)
        steps[rate] = out["time"]["host_step"]
    assert steps["25GB/s"] == pytest.approx(6 * steps["150GB/s"])


def test_named_gpu_elsewhere_uses_its_table_figure() -> None:
    target = resolve_target("H100")
    assert not target.local
    assert host_bandwidth_source(target) == (152e9, "the H100 SXM table figure; --host-bandwidth for another machine")
    assert hardware(target, None).host_update_rate == 152e9 / ADAM_BYTES_PER_PARAM


def test_this_machines_gpu_is_probed(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a GPU machine resolve_target() gives a local target; here one is made as it would be.
    local = Target("cuda", "H100 SXM", 80 * 2**30, local=True)
    monkeypatch.setattr(importlib.import_module("hybridtrain.planner.estimate"), "probe_host_bandwidth", lambda: 40e9)
    assert host_bandwidth_source(local) == (40e9, "measured here")
    probed = estimate(OFFLOAD, local).time.host_step
    table = estimate(OFFLOAD, Target("cuda", "H100 SXM", 80 * 2**30)).time.host_step
    assert probed == pytest.approx(table * 152e9 / 40e9)
    given = Target("cuda", "H100 SXM", 80 * 2**30, host_bandwidth=80e9, local=True)
    assert host_bandwidth_source(given) == (80e9, "given")


def test_probe_is_short_and_cached() -> None:
    first = probe_host_bandwidth()
    assert first > 1e8  # any DRAM streams faster than 100 MB/s
    assert probe_host_bandwidth() == first  # measured once per process
