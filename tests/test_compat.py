"""Private APIs of torch, optuna, prometheus_client and argparse are used only through
:mod:`hybridtrain.compat`, each with its reason: the package's source is read for any other
use (an underscored module or name imported, an underscored attribute of torch, a
module's private ``_buffers``/``_parameters``/``_modules``, argparse's internals)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hybridtrain import compat

PACKAGE = Path(__file__).resolve().parents[1] / "hybridtrain"
LIBRARIES = ("torch", "optuna", "prometheus_client", "argparse")
PRIVATE_ATTRIBUTES = {"_buffers", "_parameters", "_modules", "_negative_number_matcher", "_option_string_actions",
                      "_actions"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def private_uses(source: str) -> list[str]:
    """``line: what`` for each private use in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            module = (node.module or "") if isinstance(node, ast.ImportFrom) else ""
            names = [a.name for a in node.names]
            for dotted in ([module] if module else names):
                parts = dotted.split(".")
                if parts[0] in LIBRARIES and any(_private(p) for p in parts):
                    found.append(f"{node.lineno}: import {dotted}")
            if module.split(".")[0] in LIBRARIES and any(_private(n) or n == "floatToGoString" for n in names):
                found.append(f"{node.lineno}: from {module} import {', '.join(names)}")
        elif isinstance(node, ast.Attribute) and (
                node.attr in PRIVATE_ATTRIBUTES or (_private(node.attr) and _root(node) == "torch")):
            found.append(f"{node.lineno}: .{node.attr}")
    return found


def test_private_apis_are_used_through_the_compatibility_module_only() -> None:
    uses = {path.relative_to(PACKAGE).as_posix(): private_uses(path.read_text())
            for path in sorted(PACKAGE.rglob("*.py")) if path.name != "compat.py"}
    assert {path: found for path, found in uses.items() if found} == {}


@pytest.mark.parametrize(("source", "found"), [
    ("from torch.utils._pytree import tree_map", ["1: import torch.utils._pytree"]),
    ("from prometheus_client.utils import floatToGoString",
     ["1: from prometheus_client.utils import floatToGoString"]),
    ("import torch\ntorch._foo_(x)", ["2: ._foo_"]),
    ("m._buffers['b'] = t", ["1: ._buffers"]),
    ("from torch.utils.checkpoint import checkpoint", []),
])
def test_the_check_sees_private_uses(source: str, found: list[str]) -> None:
    assert [f.split(": ", 1)[1] for f in private_uses(source)] == [f.split(": ", 1)[1] for f in found]


def test_every_name_resolves_on_this_torch() -> None:
    for name in ("tree_flatten", "tree_unflatten", "tree_leaves", "tree_map", "tree_map_only", "TorchDispatchMode",
                 "is_traceable_wrapper_subclass"):
        assert callable(getattr(compat, name))
    forward, backward = compat.cpu_flash_attention()
    assert "flash_attention_for_cpu" in str(forward) and "backward" in str(backward)
