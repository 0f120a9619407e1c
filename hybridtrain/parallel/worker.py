"""What torchrun runs on each rank for ``hybridtrain launch``: the user's script, with its
failure recorded.

torchrun gives every worker an error file (``TORCHELASTIC_ERROR_FILE``); a script whose
main function is not decorated with torch's ``@record`` leaves it empty, and then the
launcher cannot tell the rank that failed from the ranks that failed because it did (all
exit with code 1 within the same second). This module runs the script as ``__main__``
(as ``python SCRIPT`` or ``python -m MODULE`` would) and, if it raises, records the
exception — a collective that lost its peer as
:class:`~hybridtrain.errors.PeerFailure` — before the usual traceback and exit code 1.

    python -m hybridtrain.parallel.worker SCRIPT [ARGS…]
    python -m hybridtrain.parallel.worker -m MODULE [ARGS…]
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence


def main(argv: Sequence[str]) -> None:
    """Run the script or module ``argv`` names with the rest of ``argv`` as its arguments."""
    module = bool(argv) and argv[0] == "-m"
    target, args = (argv[1], argv[2:]) if module else (argv[0], argv[1:])
    sys.argv = [target, *args]
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            # As `python SCRIPT`: the script's directory comes first on the import path.
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except SystemExit:
        raise
    except KeyboardInterrupt:  # Ctrl-C, passed on by the launcher, which says it in one line
        sys.exit(130)
    except BaseException as exc:
        _record(exc)
        raise


def _record(exc: BaseException) -> None:
    if "TORCHELASTIC_ERROR_FILE" not in os.environ:
        return
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    from hybridtrain.errors import peer_failure

    ErrorHandler().record_exception(peer_failure(exc) or exc)


if __name__ == "__main__":
    main(sys.argv[1:])
