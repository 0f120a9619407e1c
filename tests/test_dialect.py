"""DeepSpeed's dialect lives in its own rooms (``hybridtrain/deepspeed/``, ``hybridtrain/optim/
deepspeed/``, ``config/deepspeed_keys.py`` and its neighbours): the engine's core — runtime/,
plan/, parallel/, engine.py, prepare.py — has no code naming DeepSpeed. Comments and
docstrings may cite DeepSpeed as the source a rule follows."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hybridtrain"
CORE = ["runtime", "plan", "parallel", "engine.py", "prepare.py"]


def _core_files() -> list[Path]:
    files: list[Path] = []
    for name in CORE:
        path = PACKAGE / name
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def _docstring_lines(source: str) -> set[int]:
    """Lines of the string statements (docstrings, and strings standing alone as notes)."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines


def code_naming_deepspeed(source: str) -> list[tuple[int, str]]:
    """``(line, token)`` for each name or string of code (comments and docstrings aside)
    that says "deepspeed" in any case."""
    notes = _docstring_lines(source)
    kinds = {tokenize.NAME, tokenize.STRING, *(getattr(tokenize, k) for k in ("FSTRING_MIDDLE", "TSTRING_MIDDLE")
                                                 if hasattr(tokenize, k))}
    return [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type in kinds and "deepspeed" in tok.string.lower() and tok.start[0] not in notes]


def test_the_check_sees_code_and_skips_comments_and_docstrings() -> None:
    source = '"""DeepSpeed\'s rule."""\nimport hybridtrain.deepspeed  # DeepSpeed\nx = f"a {y} deepspeed"\n'
    assert [line for line, _ in code_naming_deepspeed(source)] == [2, 3]


@pytest.mark.parametrize("path", _core_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_core_has_no_code_naming_deepspeed(path: Path) -> None:
    assert code_naming_deepspeed(path.read_text()) == []
