"""``python -m hybridtrain.deepspeed SCRIPT``: inside the script's process ``import deepspeed``,
its submodules and the frameworks' version checks resolve to hybridtrain's drop-in even with
the real DeepSpeed installed beside it, while this (the parent) process and other programs
still see the environment as it is. (``hybridtrain launch``'s ranks: the two-rank Trainer
test in test_frameworks.py, where the real DeepSpeed is unusable.)"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert report["aio_compatible"] is False  # transformers' require_deepspeed_aio skips NVMe tests
    assert "No module named 'deepspeed.not_a_module': hybridtrain's DeepSpeed drop-in" in report["missing"]
    assert report["engine"] == "hybridtrain.deepspeed.engine" and report["steps"] == 2 and report["world"] == world


def test_python_m_hybridtrain_deepspeed_wins_over_the_installed_deepspeed(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "hybridtrain.deepspeed", str(SCRIPTS / "dropin_probe.py"),
                           str(tmp_path / "report")], env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check(json.loads((tmp_path / "report.0").read_text()), world=1)
    # This process did not install it: whatever is installed here is what it sees.
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        assert "+hybridtrain" not in importlib.metadata.version("deepspeed")
    assert "deepspeed" not in sys.modules or not sys.modules["deepspeed"].__name__.startswith("hybridtrain")


def test_a_missing_script_argument_prints_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    from hybridtrain.deepspeed.__main__ import run

    with pytest.raises(SystemExit) as exit_info:
        run([])
    assert exit_info.value.code == 2 and "python -m hybridtrain.deepspeed SCRIPT" in capsys.readouterr().out
