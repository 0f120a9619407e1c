"""``python -m hybridtrain COMMAND …`` = ``hybridtrain COMMAND …`` (what subprocesses, torchrun's
ranks and containers run): the package's entry, a command like those of :mod:`hybridtrain.commands`."""

from __future__ import annotations

import sys

from hybridtrain.commands.cli import main

if __name__ == "__main__":
    sys.exit(main())
