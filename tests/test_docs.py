"""The README and docs/ keep their promises: two Quick-start commands (CI runs the test one), a README
that fits on a screen or two, links that lead somewhere, the config reference is the schema's, the
results table is one link away, and docs/architecture.md places every part of the package in its layer."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tests.test_layers import LAYERS, _layer

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = sorted((ROOT / "docs").glob("*.md"))
README_MAX_LINES = 600


def _quick_start_commands() -> list[str]:
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(?:sh|bash|shell)\n(.*?)```", section, flags=re.S)
    return [line for block in blocks for line in block.strip().splitlines() if line.strip()]


def test_quick_start_has_exactly_two_commands_and_ci_runs_the_test_one() -> None:
    commands = _quick_start_commands()
    assert len(commands) == 2, commands
    assert "hybridtrain train" in commands[0] and "torch==2.13.0" in commands[0]
    assert "pytest" in commands[1] and "torch==2.13.0" in commands[1]
    # CI runs the test command's steps in order (it may wait for its system packages between them).
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    at = 0
    for step in commands[1].split(" && "):
        at = ci.find(step, at)
        assert at >= 0, f".ci/run lacks, in order, the README's step {step!r}"


def test_readme_fits_on_a_screen_or_two() -> None:
    assert len(README.splitlines()) <= README_MAX_LINES


def test_config_reference_is_up_to_date() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from update_config_reference import REFERENCE, render
    finally:
        sys.path.pop(0)
    document = REFERENCE.read_text(encoding="utf-8")
    assert render(document) == document, "run: python scripts/update_config_reference.py"


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a document's headings: lower case, punctuation dropped, spaces as dashes."""
    headings = re.findall(r"^#+ (.+)$", markdown, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def _broken_links(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold commands, not links
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # a web address: not checked offline
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{path.name}: {target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked.read_text(encoding="utf-8")):
            broken.append(f"{path.name}: {target} (no such heading)")
    return broken


def test_links_in_readme_and_docs_lead_somewhere() -> None:
    broken = [link for path in [ROOT / "README.md", *DOCS] for link in _broken_links(path)]
    assert broken == []


def test_results_table_is_one_link_from_the_readme_with_machine_date_and_commit() -> None:
    assert "(docs/results.md#results)" in README
    results = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    table = results.split("<!-- benchmark-results:start -->", 1)[1].split("<!-- benchmark-results:end -->", 1)[0]
    assert table.splitlines()[1] == "| benchmark | result | machine, date, commit |"


def _documented_layers() -> dict[int, str]:
    """The numbered items of docs/architecture.md's "Layers" list: ``{number: text}``."""
    section = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8").split("\n## Layers\n", 1)[1]
    items = re.split(r"^(\d+)\. ", section, flags=re.M)[1:]
    return {int(number): text for number, text in zip(items[::2], items[1::2], strict=True)}


def _parts() -> dict[str, str]:
    """Every top-level package and module of hybridtrain/ (``__init__`` aside), as the docs write it:
    ``{"config": "config/", "engine": "engine.py", ...}``."""
    package = ROOT / "hybridtrain"
    modules = {path.stem: path.name for path in package.glob("*.py") if path.stem != "__init__"}
    packages = {path.parent.name: f"{path.parent.name}/" for path in package.glob("*/__init__.py")}
    return dict(sorted({**modules, **packages}.items()))


def test_architecture_names_every_part_in_its_layer() -> None:
    layers = _documented_layers()
    assert sorted(layers) == list(range(1, len(LAYERS) + 1))
    misplaced = []
    for part, written in _parts().items():
        named_in = [number for number, text in layers.items() if f"`{written}`" in text]
        if named_in != [_layer(f"hybridtrain.{part}") + 1]:
            layer = _layer(f"hybridtrain.{part}") + 1
            misplaced.append(f"{part}: docs/architecture.md names it in layer(s) {named_in}, not {layer}")
    assert misplaced == []
