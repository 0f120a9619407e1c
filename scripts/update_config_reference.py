"""Regenerate the config reference between the markers in README.md from the schema.

Run after changing ``hybridtrain/config/schema.py``; ``tests/test_docs.py`` fails while the
README is out of date.
"""

from __future__ import annotations

import re
from pathlib import Path

from hybridtrain.config.reference import config_reference

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def render(readme: str) -> str:
    """``readme`` with the generated reference between the markers."""
    body = f"{START}\n{config_reference()}\n{END}"
    return re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: body, readme, flags=re.S)


if __name__ == "__main__":
    README.write_text(render(README.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"updated {README}")
