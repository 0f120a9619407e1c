"""The memory picture: a PNG with the parts shaded, or None (one note) without matplotlib."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hybridtrain.profiling.counting import StepCount
from hybridtrain.profiling.plot import plot_memory

COUNT = StepCount(modules=[], forward_flops=0, backward_flops=0, peak_live_bytes=3 * 2**20,
                  timeline=[(0.0, 2**20), (0.1, 3 * 2**20), (0.2, 2**20)],
                  parts=[(0.0, "forward"), (0.1, None), (0.1, "backward"), (0.2, None)])


def test_draws_a_png(tmp_path: Path) -> None:
    out = plot_memory(COUNT, "cpu", tmp_path / "memory.png")
    assert out is not None and out.read_bytes()[:4] == b"\x89PNG"


def test_without_matplotlib_nothing_is_drawn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert plot_memory(COUNT, "cpu", tmp_path / "memory.png") is None
    assert not (tmp_path / "memory.png").exists()
