"""213 real public DeepSpeed configs (``deepspeed_corpus/``, sources in its SOURCES.md):
each trains two steps on one CPU process, or is refused in one line naming a feature
hybridtrain really lacks — never a crash."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

from hybridtrain.optim import DEEPSPEED_OPTIMIZERS

ROOT = Path(__file__).resolve().parents[2]
# Measured 2026-11-23 (168, then 184 with LAMB and the 1-bit optimizers): raise it as features land, never lower it.
TRAINS_AT_LEAST = 184
# What the refusals may name: DeepSpeed features whose math hybridtrain does not implement,
# or settings that need more processes than this one.
ABSENT = ("1-bit", "0/1 Adam", "LAMB", "compression_training", "data_efficiency", "NVMe offload", "amp:",
          "master weights", "eigenvalue", "progressive_layer_drop", "Ulysses", "sparse_attention", "ZenFlow",
          "do not divide the world size",
          "max_grad_norm")


def _report() -> ModuleType:
    script = ROOT / "scripts" / "deepspeed_corpus_report.py"
    spec = importlib.util.spec_from_file_location("deepspeed_corpus_report", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_real_configs_train_or_are_refused_in_one_line() -> None:
    report = _report()
    results = [report.run_file(path) for path in sorted(report.CORPUS.glob("*.json"))]
    assert len(results) >= 200
    crashed = [(r.file, r.error_type, r.message) for r in results if r.outcome == "crashed"]
    assert not crashed
    refused = [r for r in results if r.outcome == "refused"]
    assert all("\n" not in r.message for r in refused)
    unexplained = [(r.file, r.message) for r in refused if not any(word in r.message for word in ABSENT)]
    assert not unexplained
    trains = sum(r.outcome == "trains" for r in results)
    assert trains >= TRAINS_AT_LEAST, f"{trains} of {len(results)} train"
    # DeepSpeed's own optimizers are built as DeepSpeed's classes, not a stand-in.
    for r in results:
        name = str(json.loads((report.CORPUS / r.file).read_text()).get("optimizer", {}).get("type", "")).lower()
        if r.outcome == "trains" and name in DEEPSPEED_OPTIMIZERS:
            assert r.optimizer == DEEPSPEED_OPTIMIZERS[name].__name__, (r.file, r.optimizer)
