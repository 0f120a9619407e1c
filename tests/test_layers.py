"""The package's import graph, read from the source (every import statement: top level,
inside functions, under TYPE_CHECKING): no cycle, and no import that climbs back up the
layers of docs/architecture.md ("Layers")."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS: list[list[str]] = [  # bottom first; a module may import its own layer and those below
    ["units", "cli_parser", "hardware", "compat", "bounded_parse"],  # plain tables and parsers
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
    ["", "cli", "train_cli", "commands", "hpo.cli", "hpo.__main__", "service.cli",
     "deepspeed.__main__"],  # commands
]


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
    """The layer of the longest prefix in :data:`LAYERS` that names ``module``."""
    best, length = -1, -1
    for index, names in enumerate(LAYERS):
        for short in names:
            full = f"hybridtrain.{short}" if short else "hybridtrain"
            if (module == full or module.startswith(full + ".")) and len(full) > length:
                best, length = index, len(full)
    assert best >= 0, f"{module} has no layer: add it to LAYERS here and in docs/architecture.md"
    return best


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
