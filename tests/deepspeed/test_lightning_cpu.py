"""Lightning's and Fabric's own DeepSpeed strategy names on the CPU under the drop-in
(``python -m hybridtrain.deepspeed``), the script importing nothing of hybridtrain: the
strategies are Lightning's classes, their CUDA-only checks lifted on a CPU accelerator."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deepspeed.frameworks import finish, start

pytest.importorskip("lightning")


@pytest.mark.parametrize("name", ["deepspeed_stage_2_offload", "deepspeed_stage_3"])
def test_lightnings_strategy_names_train_on_the_cpu(tmp_path: Path, name: str) -> None:
    out = finish(start("lightning_names_on_cpu.py", [name], tmp_path, real=False),
                 f"Trainer and Fabric with strategy={name!r} on the CPU")
    assert "trainer strategy lightning.pytorch.strategies.deepspeed 2" in out
    assert "fabric strategy lightning.fabric.strategies.deepspeed" in out
