"""Byte counts as people write them (``24GiB``, ``512MB``) and as they read them
(``1.50 GiB``). Plain Python: the config schema parses sizes with it without importing torch."""

from __future__ import annotations

import re

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTES = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?\s*([A-Za-z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """A byte count from ``24GiB``, ``512MB``, ``1e9``, ``"1024"`` or an integer.

    Units: B, kB, MB, GB, TB (powers of 1000) and KiB, MiB, GiB, TiB (powers of 1024), any
    case. The result must be a whole, non-negative number of bytes.

    Raises:
        ValueError: one line naming the value and what is allowed.
    """
    allowed = ("an integer number of bytes or a number with a unit such as 512MB or 24GiB "
               "(B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{value!r} is not a byte count; use {allowed}")
    if isinstance(value, str):
        match = _BYTES.match(value)
        if match is None or match.group(3).lower() not in _UNITS | {"": 1}:
            raise ValueError(f"{value!r} is not a byte count; use {allowed}")
        number, exponent, unit = match.groups()
        amount = float(f"{number}e{exponent or 0}") * _UNITS.get(unit.lower(), 1)
    else:
        amount = float(value)
    if not amount >= 0 or amount != int(amount) or amount == float("inf"):
        raise ValueError(f"{value!r} is not a whole, non-negative number of bytes; use {allowed}")
    return int(amount)


def parse_rate(value: int | float | str) -> float:
    """Bytes per second from ``152GB/s``, ``25 GiB/s``, ``1.5e11`` (bytes/s) or a number.

    The number and unit are :func:`parse_bytes`'s (a fraction is allowed), ``/s`` optional.

    Raises:
        ValueError: one line naming the value and what is allowed (a positive rate).
    """
    allowed = "a positive number of bytes per second such as 152GB/s or 25GiB/s (units B, kB, MB, GB, TB, KiB … TiB)"
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{value!r} is not a bandwidth; use {allowed}")
    text = value.strip().removesuffix("/s").removesuffix("/S") if isinstance(value, str) else value
    match = _BYTES.match(text) if isinstance(text, str) else None
    if isinstance(text, str) and (match is None or match.group(3).lower() not in _UNITS | {"": 1}):
        raise ValueError(f"{value!r} is not a bandwidth; use {allowed}")
    if match is not None:
        number, exponent, unit = match.groups()
        amount = float(f"{number}e{exponent or 0}") * _UNITS.get(unit.lower(), 1)
    else:
        amount = float(text)
    if not 0 < amount < float("inf"):
        raise ValueError(f"{value!r} is not a positive bandwidth; use {allowed}")
    return amount


def format_bytes(count: float) -> str:
    """``1.50 GiB``, ``12.0 MiB``, ``512 B``: the unit that keeps the number readable."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(count) >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{int(count)} B"
