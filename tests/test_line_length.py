"""Lines of at most 120 columns in every Python file of the house: the package, its tests,
benchmarks and scripts (the ruff setting in pyproject.toml, checked here without ruff). As
ruff's E501 does, a trailing pragma (``# type: ignore[...]``, ``# noqa``) does not count, nor
does a file that others wrote, kept as they wrote it (``# ruff: noqa`` in its header)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_COLUMNS = 120
FOLDERS = ("hybridtrain", "tests", "benchmarks", "scripts", "examples")
PRAGMA = re.compile(r"\s*#\s*(type:\s*ignore\S*|noqa\S*|pragma\S*)(\s.*)?$")


def test_no_python_line_is_over_120_columns() -> None:
    too_wide = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            lines = path.read_text(encoding="utf-8").splitlines()
            if any(line.startswith("# ruff: noqa") for line in lines[:5]):
                continue
            for number, line in enumerate(lines, start=1):
                if len(PRAGMA.sub("", line)) > MAX_COLUMNS:
                    too_wide.append(f"{path.relative_to(ROOT).as_posix()}:{number} ({len(line)})")
    assert too_wide == [], f"wrap these lines to {MAX_COLUMNS} columns: {too_wide[:20]}"
