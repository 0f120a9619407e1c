"""``python -m hybridtrain.hpo COMMAND …``: the ``hybridtrain hpo`` commands on their own."""

from __future__ import annotations

import sys

from hybridtrain.commands.hpo import main

if __name__ == "__main__":
    sys.exit(main())
