"""The package's import graph, read from the source (every import statement: top level,
inside functions, under TYPE_CHECKING): no cycle, no two parts that import each other, and
no import that climbs back up the layers of docs/architecture.md ("Layers").

A part is a top-level module or package of hybridtrain/; the layers name parts only, each
once. One rule places modules inside a part: a package's ``__main__`` (``python -m
hybridtrain.X``) is a command, in the commands' layer whatever its package."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS: list[list[str]] = [  # bottom first; a module may import its own layer and those below
    ["units", "hardware", "compat", "bounded_parse"],           # plain tables and parsers
    ["config"],
    ["data", "models", "metrics", "stopping", "terminate", "run_dir", "run_lock", "outputs",
     "optim"],                                                 # optimizers and schedules by name
    ["runtime"],                                               # one-process techniques
    ["parallel"],
    ["profiling"],
    ["monitoring"],
    ["checkpoint"],
    ["engine"],
    ["plan"],                                                  # resolve, build, the variants
    ["planner"],
    ["prepare", "compose"],                                    # the one road, initialize
    ["recovery"],                                              # memory policy above the engine
    ["errors", "trainer", "training_inputs"],
    ["deepspeed", "report", "server"],                          # server: what both services share
    ["service"],
    ["hpo"],                                                   # its trials are service jobs
    ["", "commands"],  # the commands (and every package's __main__), the package's face
]
COMMANDS = len(LAYERS) - 1


@functools.cache
def _modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "hybridtrain").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


@functools.cache
def _edges() -> dict[str, set[tuple[str, int]]]:
    return _imports(_modules())


def _imports(modules: dict[str, Path]) -> dict[str, set[tuple[str, int]]]:
    """``module -> {(imported module, line)}`` within the package (a module importing its
    own package or subpackages is left out, as Python runs those ``__init__`` anyway)."""
    edges: dict[str, set[tuple[str, int]]] = {m: set() for m in modules}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*here[:len(here) - node.level + 1], *([base] if base else [])])
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + ".") \
                        and not target.startswith(name + "."):
                    edges[name].add((target, node.lineno))
    return edges


def _layer(module: str) -> int:
    """The layer of ``module``'s part (a package's ``__main__``: the commands')."""
    if module.rpartition(".")[2] == "__main__":
        return COMMANDS
    part = _part(module)
    layers = [index for index, names in enumerate(LAYERS) if part in names]
    assert layers, f"{module}: its part {part!r} has no layer: add it to LAYERS here and in docs/architecture.md"
    return layers[0]


def _part(module: str) -> str:
    """``hybridtrain.hpo.api`` -> ``hpo``; the package itself -> ``""``."""
    return module.split(".")[1] if "." in module else ""


def test_the_layers_name_parts_each_once() -> None:
    names = [name for names in LAYERS for name in names]
    assert len(names) == len(set(names))
    parts = {_part(module) for module in _modules()} - {"__main__"}
    assert sorted(names) == sorted(parts), "LAYERS must name every part of hybridtrain/ and nothing else"


def test_no_two_parts_import_each_other() -> None:
    def part(module: str) -> str:
        return "commands" if module.rpartition(".")[2] == "__main__" else _part(module)

    imports = {(part(source), part(target)) for source, targets in _edges().items() for target, _ in targets}
    both_ways = sorted(f"{a} <-> {b}" for a, b in imports if a < b and (b, a) in imports)
    assert both_ways == []


def test_no_import_climbs_back_up_the_layers() -> None:
    edges = _edges()
    upward = [f"{source}:{line} imports {target}" for source, targets in sorted(edges.items())
              for target, line in sorted(targets) if _layer(target) > _layer(source)]
    assert upward == []


def test_no_import_cycle() -> None:
    graph = {m: {t for t, _ in targets} for m, targets in _edges().items()}
    done: set[str] = set()

    def cycle_from(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node):], node]
        if node in done:
            return None
        for nxt in sorted(graph[node]):
            found = cycle_from(nxt, [*path, node])
            if found:
                return found
        done.add(node)
        return None

    cycles = [c for c in (cycle_from(m, []) for m in sorted(graph)) if c]
    assert cycles == []


def test_the_layers_are_the_documented_ones() -> None:
    documented = (ROOT / "docs" / "architecture.md").read_text()
    for names in LAYERS:
        for short in names:
            if short:
                assert f"`{short.replace('.', '/')}" in documented, f"{short} is not in docs/architecture.md"
