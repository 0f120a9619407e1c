"""The argument parser every ``hybridtrain`` command line is read with (top level and
sub-commands), apart from ``cli.py`` so a sub-command module can use it without importing
the whole command tree."""

from __future__ import annotations

import argparse
from typing import Any

from hybridtrain.compat import take_dash_digit_words_as_values


class CommandParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` that takes a value written after its option with a space
    and a leading minus (``--device-memory -5GB``, ``--margin -1e-3``) as that option's
    value, as ``--device-memory=-5GB`` is taken.

    Plain argparse reads only ``-5`` and ``-.5`` that way and calls ``-5GB`` or ``-1e-3``
    an unknown option ("expected one argument"; CPython issues 105712 and 123945 widen it
    to numbers only). No hybridtrain option is named like ``-<digit>``, so a word that
    starts with ``-`` and a digit is always a value. Sub-command parsers are of this class
    too (``add_subparsers`` makes them of the parent's class).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        take_dash_digit_words_as_values(self)
