"""What torchrun runs on each rank for ``hybridtrain launch``: the user's script, with its
failure recorded.

torchrun gives every worker an error file (``TORCHELASTIC_ERROR_FILE``); a script whose
main function is not decorated with torch's ``@record`` leaves it empty, and then the
launcher cannot tell the rank that failed from the ranks that failed because it did (all
exit with code 1 within the same second). This module runs the script as ``__main__``
(as ``python SCRIPT`` or ``python -m MODULE`` would) and, if it raises, records the
exception — a collective that lost its peer as
:class:`~hybridtrain.errors.PeerFailure` — before the usual traceback and exit code 1.
:func:`record_failure` writes that file for ``hybridtrain train``'s ranks too.

A script that ends normally leaves a marker for the launcher (:func:`finished_marker`)
once its atexit handlers have run, and then its process group (if it did not) at
interpreter exit: a rank that dies of a signal after the marker (in the teardown) finished
its work, and the launcher says so instead of reporting a crash.

    python -m hybridtrain.parallel.worker SCRIPT [ARGS…]
    python -m hybridtrain.parallel.worker -m MODULE [ARGS…]
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence


def main(argv: Sequence[str]) -> None:
    """Run the script or module ``argv`` names with the rest of ``argv`` as its arguments."""
    module = bool(argv) and argv[0] == "-m"
    target, args = (argv[1], argv[2:]) if module else (argv[0], argv[1:])
    if not module:
        _exit_if_unopenable(target)
    sys.argv = [target, *args]
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        # A script's own @record writes the error file the way record_failure explains it
        # must not be written; it gets a file of its own, the launcher's gets ours.
        os.environ["TORCHELASTIC_ERROR_FILE"] = error_file + ".script"
    finished: list[bool] = []
    # atexit runs last-in, first-out: the script's own handlers, then the marker (the
    # script's work is done), then the group's teardown, the step that can abort.
    marker = finished_marker(os.environ.get("RANK", "0"))
    if marker:  # a restarted round's rank has not finished yet, whatever the last round did
        with contextlib.suppress(OSError):
            os.unlink(marker)
    atexit.register(_leave_process_group, finished)
    atexit.register(_mark_finished, finished)
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            # As `python SCRIPT`: the script's directory comes first on the import path.
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
        finished.append(True)
    except SystemExit as exc:
        if exc.code in (None, 0):
            finished.append(True)
        raise
    except KeyboardInterrupt:  # Ctrl-C, passed on by the launcher, which says it in one line
        sys.exit(130)
    except BaseException as exc:
        from hybridtrain.parallel.peer_failure import peer_failure

        record_failure(peer_failure(exc) or exc, error_file)
        raise


FINISHED_DIR_ENV = "HYBRIDTRAIN_FINISHED_DIR"
"""The directory ``hybridtrain launch`` gives its ranks for the markers of :func:`finished_marker`."""


def finished_marker(rank: int | str) -> str | None:
    """The file rank ``rank`` writes once its script has ended normally and its own atexit
    handlers have run (before the group's teardown); None outside ``hybridtrain launch``."""
    directory = os.environ.get(FINISHED_DIR_ENV)
    return os.path.join(directory, f"rank-{rank}.finished") if directory else None


def _mark_finished(finished: list[bool]) -> None:
    marker = finished_marker(os.environ.get("RANK", "0"))
    if marker and finished:
        with contextlib.suppress(OSError):
            open(marker, "w").close()


def _leave_process_group(finished: list[bool]) -> None:
    # Only after a normal end (a failing rank exits at once, so that the launcher sees its own
    # error first rather than its peer's lost connection), and only where the script used
    # torch.distributed: other scripts do not import torch for it.
    if finished and "torch.distributed" in sys.modules:
        from hybridtrain.parallel.mesh import leave_process_group

        leave_process_group()


def _exit_if_unopenable(script: str) -> None:
    """Exit as ``python SCRIPT`` does when ``SCRIPT`` cannot be opened: one line, status 2,
    no traceback of this module's."""
    try:
        os.stat(script)
    except OSError as exc:
        program = (getattr(sys, "orig_argv", None) or [sys.executable])[0]
        print(f"{program}: can't open file '{os.path.abspath(script)}': [Errno {exc.errno}] {exc.strerror}",
              file=sys.stderr, flush=True)
        sys.exit(2)


def record_failure(exc: BaseException, error_file: str | None = None) -> None:
    """Write ``exc`` to this worker's torchrun error file (``error_file``, by default
    ``TORCHELASTIC_ERROR_FILE``; a no-op outside torchrun) in torchrun's error-file format,
    all at once.

    Why not torch's ``ErrorHandler.record_exception``: it opens the file for writing (now
    empty) and then writes it. When a peer dies, torchrun's agent stops the other ranks with
    SIGTERM and then reads their error files; a rank stopped between the two steps leaves
    an empty file, the agent fails to parse it and exits without restarting the group.
    Here the JSON goes to a temporary file in the same directory that replaces the error
    file in one rename: the agent finds a complete file or none.
    """
    path = error_file or os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": f"{type(exc).__name__}: {exc}",
                          "extraInfo": {"py_callstack": "".join(traceback.format_exception(exc)),
                                        "timestamp": str(int(time.time()))}}}
    handle, temporary = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".error-", suffix=".json")
    try:
        with os.fdopen(handle, "w") as out:
            json.dump(record, out)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
