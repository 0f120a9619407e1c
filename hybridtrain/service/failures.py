"""A failed attempt's reason in one line: OOM, a killed rank, a bad config, or the error.

Read from the exit code and the last lines of the job's output, where ``hybridtrain
train`` prints one ``error: …`` line and ``hybridtrain launch`` names the rank that
failed first.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

#: Exit code of ``hybridtrain`` commands for bad input (config, arguments): no restart helps.
BAD_INPUT = 2
_OOM = re.compile(r"out of memory|OutOfMemoryError|CUDA error: out of memory", re.I)


def tail_lines(path: Path, n: int = 40, max_bytes: int = 16384) -> list[str]:
    """The last ``n`` non-empty lines of ``path`` (empty if it cannot be read)."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    # The local backend's "--- attempt K on … ---" headers are ours, not the job's words.
    return [line.strip() for line in text.splitlines()
            if line.strip() and not line.startswith("--- attempt ")][-n:]


def describe_exit(code: int | None, log: Path) -> tuple[str, bool]:
    """``(reason, restartable)`` of an attempt that ended with ``code`` (not 0).

    Args:
        code: the exit code (128 + N for signal N), or ``None`` when unknown.
        log: the job's output file.

    Returns:
        A one-line reason, and whether a restart may help (not for bad input).
    """
    lines = tail_lines(log)
    errors = [line for line in lines if line.startswith("error:")]
    detail = (errors[-1] if errors else (lines[-1] if lines else ""))[:300]
    if any(_OOM.search(line) for line in lines):
        oom = next(line for line in reversed(lines) if _OOM.search(line))
        return f"OOM: {oom[:300]}", True
    if code is None:
        return "ended without an exit code" + (f": {detail}" if detail else ""), True
    if code > 128 and code - 128 in signal.valid_signals():
        name = signal.Signals(code - 128).name
        what = " (the kernel's OOM killer, or kill -9)" if name == "SIGKILL" else ""
        return f"killed by {name}{what}" + (f": {detail}" if detail else ""), True
    if code == BAD_INPUT:
        return f"bad config or arguments (exit 2): {detail}", False
    if re.search(r"\brank \d+\b.*failed|rank \d+ \(local rank", detail):
        return f"a rank failed (exit {code}): {detail}", True
    return f"exit code {code}" + (f": {detail}" if detail else ""), True
