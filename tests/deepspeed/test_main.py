"""``python -m hybridtrain.deepspeed SCRIPT`` with no launcher variables, as the README writes
it: the one-process group is set up as under ``deepspeed SCRIPT`` (a Hugging Face Trainer
script logging every step used to stop at its first log with "Default process group has not
been initialized")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.deepspeed.frameworks import finish, start

pytest.importorskip("transformers")


def test_a_trainer_script_runs_in_one_process_without_launcher_variables(tmp_path: Path) -> None:
    from tests.deepspeed.scripts.common import DS_CONFIG

    config = tmp_path / "ds.json"
    config.write_text(json.dumps(DS_CONFIG))
    record = tmp_path / "record"
    finish(start("trainer_script.py", [str(config), str(tmp_path / "work"), str(record)], tmp_path, real=False,
                 launcher_env=False), "the Trainer script under python -m hybridtrain.deepspeed")
    for part in ("full", "resumed"):
        assert json.loads(Path(f"{record}.{part}").read_text())["steps"][-1] == 6
