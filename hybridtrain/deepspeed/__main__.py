"""Run a script written for DeepSpeed (or a Hugging Face ``Trainer``, Accelerate or Lightning
script with a DeepSpeed config) unchanged on hybridtrain, in one process::

    python -m hybridtrain.deepspeed SCRIPT [ARGS…]
    python -m hybridtrain.deepspeed -m MODULE [ARGS…]

``import deepspeed`` (and its submodules and version checks) inside the script resolve to
:mod:`hybridtrain.deepspeed` (see :mod:`hybridtrain.deepspeed.dropin`). Without a launcher's
variables, those of one process are set, as ``deepspeed script.py`` sets them, so the
frameworks (and ``deepspeed.initialize``) set up the one-process group DeepSpeed would. For several processes,
``hybridtrain launch --nproc-per-node N SCRIPT [ARGS…]`` runs every rank this way.
"""

from __future__ import annotations

import sys

from hybridtrain.deepspeed.comm import set_one_process_environment
from hybridtrain.deepspeed.dropin import install
from hybridtrain.parallel.worker import main


def run(argv: list[str]) -> None:
    """Install the drop-in, then run ``argv`` (``SCRIPT ARGS…`` or ``-m MODULE ARGS…``) as ``__main__``."""
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if argv else 2)
    install()
    set_one_process_environment()  # as `deepspeed script.py` on one process
    main(argv)


if __name__ == "__main__":
    run(sys.argv[1:])
