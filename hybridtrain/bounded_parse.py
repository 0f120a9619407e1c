"""Reading JSON and YAML a user (or an attacker) wrote, within bounds.

A config, an HPO spec or a ``--set`` value is a small tree. Two inputs are not: a value
nested 100,000 levels deep (the parsers recurse and die with ``RecursionError``), and a
YAML "billion laughs" — aliases of aliases, each tiny in the file, that expand to
billions of values once anything walks the tree (validation, a deep copy, a dump), and
run the machine out of memory. :func:`check_bounds` walks the parsed value as the tree
it stands for, without expanding anything, and stops at :data:`MAX_DEPTH` levels or
:data:`MAX_VALUES` values: one ``ValueError`` line naming the source, at once.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

MAX_DEPTH = 100
"""Deepest nesting accepted (real configs and specs are under 10 levels deep)."""
MAX_VALUES = 1_000_000
"""Most values a document may stand for once its YAML aliases are expanded."""


class TooLargeError(ValueError):
    """A document nested too deeply or expanding to too many values."""


def check_bounds(value: Any, source: str) -> Any:
    """Return ``value`` after checking it is at most :data:`MAX_DEPTH` deep and stands
    for at most :data:`MAX_VALUES` values (a shared alias counted each time it is used).

    Raises:
        TooLargeError: one line naming ``source`` and the bound.
    """
    # Values seen, counted once per (container, depth) they are reached from: a shared
    # subtree's size is computed once, so a billion laughs costs a few steps per level.
    sizes: dict[int, int] = {}

    def size(node: Any, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise TooLargeError(f"{source} is nested more than {MAX_DEPTH} levels deep")
        if not isinstance(node, dict | list | tuple):
            return 1
        known = sizes.get(id(node))
        if known is not None:
            return known
        children = list(node.keys()) + list(node.values()) if isinstance(node, dict) else list(node)
        total = 1
        for child in children:
            total += size(child, depth + 1)
            if total > MAX_VALUES:
                raise TooLargeError(f"{source} stands for more than {MAX_VALUES:,} values (YAML aliases "
                                    "expanding?); write it out or make it smaller")
        sizes[id(node)] = total
        return total

    size(value, 0)
    return value


def load_json(text: str, source: str) -> Any:
    """``json.loads`` within the bounds of :func:`check_bounds`.

    Raises:
        TooLargeError: too deep or too large.
        json.JSONDecodeError: not JSON.
    """
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooLargeError(f"{source} is nested more than {MAX_DEPTH} levels deep") from None
    return check_bounds(value, source)


def load_yaml(text: str, source: str, loader: type[yaml.SafeLoader] = yaml.SafeLoader) -> Any:
    """YAML with a safe ``loader``, within the bounds of :func:`check_bounds`.

    Raises:
        TooLargeError: too deep or too large.
        yaml.YAMLError: not YAML.
    """
    try:
        value = yaml.load(text, Loader=loader)  # noqa: S506 - a SafeLoader (sub)class
    except RecursionError:
        raise TooLargeError(f"{source} is nested more than {MAX_DEPTH} levels deep") from None
    return check_bounds(value, source)
