"""``python -m hybridtrain.deepspeed SCRIPT`` and ``hybridtrain launch SCRIPT``: inside the
script's processes ``import deepspeed``, its submodules and the frameworks' version checks
resolve to hybridtrain's drop-in even with the real DeepSpeed installed beside it, while this
(the parent) process and other programs still see the environment as it is."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.deepspeed.frameworks import ROOT, SCRIPTS

pytest.importorskip("transformers")
pytest.importorskip("lightning_utilities")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(SCRIPTS)]), "OMP_NUM_THREADS": "1"}


def _check(report: dict, world: int) -> None:
    assert report["module"] == "hybridtrain.deepspeed" and report["version"] == "0.19.8+hybridtrain"
    assert report["metadata_version"] == "0.19.8+hybridtrain" and report["spec_found"]
    assert report["same_engine_class"] and report["submodule"] == "hybridtrain.deepspeed.ops.adam"
    assert report["warmup"] == "hybridtrain.deepspeed.runtime.lr_schedules" and "WarmupDecayLR" in report["schedules"]
    assert report["logger"] == "DeepSpeed" and report["lightning_check"] and report["transformers_check"]
    assert "No module named 'deepspeed.not_a_module': hybridtrain's DeepSpeed drop-in" in report["missing"]
    assert report["engine"] == "hybridtrain.deepspeed.engine" and report["steps"] == 2 and report["world"] == world


def test_python_m_hybridtrain_deepspeed_wins_over_the_installed_deepspeed(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "hybridtrain.deepspeed", str(SCRIPTS / "dropin_probe.py"),
                           str(tmp_path / "report")], env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check(json.loads((tmp_path / "report.0").read_text()), world=1)
    # This process did not install it: whatever is installed here is what it sees.
    try:
        assert "+hybridtrain" not in importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        pass
    assert "deepspeed" not in sys.modules or not sys.modules["deepspeed"].__name__.startswith("hybridtrain")


@pytest.mark.timeout(240)
def test_hybridtrain_launch_gives_every_rank_the_drop_in(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "hybridtrain.parallel.launch_cli", "--nproc-per-node", "2",
                           str(SCRIPTS / "dropin_probe.py"), str(tmp_path / "report")],
                          env=_env(), capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads((tmp_path / f"report.{rank}").read_text()) for rank in (0, 1)]
    for report in reports:
        _check(report, world=2)
    # ZeRO-2 over 2 ranks = one process stepping AdamW on the mean loss of the step's 4 samples.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.0)
    data = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    for step in range(2):
        for rank in (0, 1):
            start = 4 * step + 2 * rank
            expected = model(data[start:start + 2]).pow(2).mean().item()
            assert reports[rank]["losses"][step] == pytest.approx(expected, rel=1e-5)
        model(data[4 * step:4 * step + 4]).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_a_missing_script_argument_prints_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    from hybridtrain.deepspeed.__main__ import run

    with pytest.raises(SystemExit) as exit_info:
        run([])
    assert exit_info.value.code == 2 and "python -m hybridtrain.deepspeed SCRIPT" in capsys.readouterr().out
