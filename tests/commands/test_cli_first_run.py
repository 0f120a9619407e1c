"""The first command a new user runs prints no warning about a library hybridtrain does not
use: torch's "Failed to initialize NumPy" when numpy is absent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt_tiny.yaml"


def test_no_numpy_warning_where_numpy_is_missing() -> None:
    code = ("import sys; sys.modules['numpy'] = None; from hybridtrain.commands.cli import main; "
            f"code = main(['config', {str(EXAMPLE)!r}]); assert 'torch' in sys.modules; sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "NumPy" not in done.stderr
