"""Regenerate the config reference between the markers in docs/configuration.md from the schema.

Run after changing ``hybridtrain/config/``'s schema modules; ``tests/test_docs.py`` fails while the
reference is out of date.
"""

from __future__ import annotations

import re
from pathlib import Path

from hybridtrain.config.reference import config_reference

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def render(document: str) -> str:
    """``document`` with the generated reference between the markers."""
    body = f"{START}\n{config_reference()}\n{END}"
    return re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: body, document, flags=re.S)


if __name__ == "__main__":
    REFERENCE.write_text(render(REFERENCE.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"updated {REFERENCE}")
