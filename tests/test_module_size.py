"""Small modules, one idea each: no module of the package is over 500 lines (issue #37)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500


def test_no_module_is_over_500_lines() -> None:
    too_long = {}
    for path in sorted((ROOT / "hybridtrain").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_LINES:
            too_long[name] = lines
    assert too_long == {}, f"split these by idea (at most {MAX_LINES} lines each): {too_long}"
