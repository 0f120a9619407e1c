"""Regenerate the embedded demo corpus, ``hybridtrain/data/corpus.txt.gz``.

The text is the documentation topics bundled with CPython (``pydoc_data.topics``, PSF
licence): present on every machine, so the corpus is reproducible and nothing is written
by hand. Run: ``python scripts/build_corpus.py``.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from pydoc_data.topics import topics

TARGET = Path(__file__).resolve().parents[1] / "hybridtrain" / "data" / "corpus.txt.gz"


def main() -> None:
    text = "\n\n".join(topics[name].strip() for name in sorted(topics))
    # mtime=0 keeps the archive byte-identical across rebuilds.
    TARGET.write_bytes(gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0))
    print(f"{TARGET}: {len(text):,} characters, {TARGET.stat().st_size:,} bytes compressed")


if __name__ == "__main__":
    main()
