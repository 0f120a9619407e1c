"""The README keeps its promises: two Quick-start commands, CI runs the test one, the
config reference is the schema's."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _quick_start_commands() -> list[str]:
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(?:sh|bash|shell)\n(.*?)```", section, flags=re.S)
    return [line for block in blocks for line in block.strip().splitlines() if line.strip()]


def test_quick_start_has_exactly_two_commands_and_ci_runs_the_test_one() -> None:
    commands = _quick_start_commands()
    assert len(commands) == 2, commands
    assert "hybridtrain train" in commands[0] and "torch==2.13.0" in commands[0]
    assert "pytest" in commands[1] and "torch==2.13.0" in commands[1]
    assert commands[1] in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_readme_config_reference_is_up_to_date() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from update_config_reference import render
    finally:
        sys.path.pop(0)
    assert render(README) == README, "run: python scripts/update_config_reference.py"
