"""Byte counts: parsed as people write them, formatted as they read them; no torch needed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hybridtrain.units import format_bytes, parse_bytes


@pytest.mark.parametrize(("text", "expected"), [
    ("24GiB", 24 * 2**30), ("512MB", 512 * 10**6), ("1.5 GiB", 3 * 2**29), ("1024", 1024), ("2kib", 2048),
    (1e9, 10**9), (7, 7), ("1e3B", 1000), ("0", 0),
])
def test_parse_bytes(text: int | float | str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["24 apples", "-1GB", "1.5", "", True, 0.5, None, "GiB", float("nan")])
def test_parse_bytes_refuses_in_one_line(bad: object) -> None:
    with pytest.raises(ValueError, match="byte") as caught:
        parse_bytes(bad)  # type: ignore[arg-type]
    assert "\n" not in str(caught.value)


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (512, 3 << 20, 3 << 29)] == ["512 B", "3.00 MiB", "1.50 GiB"]


def test_the_config_schema_reads_sizes_without_importing_torch() -> None:
    code = ("import sys; from hybridtrain.config import load_config; "
            "assert load_config({'device_memory_limit': '1GiB'}).device_memory_limit == 2**30; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
