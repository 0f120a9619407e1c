"""Command-line interface: ``hybridtrain train``, ``hybridtrain hpo …``, ``hybridtrain jobs …``.

Every sub-command registers its own parser; the heavy imports (torch, optuna …) happen
inside the command functions so ``hybridtrain --help`` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Sequence

from hybridtrain import __version__
from hybridtrain.commands.parser import CommandParser
from hybridtrain.terminate import Terminated, raise_on_sigterm


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every sub-command."""
    parser = CommandParser(
        prog="hybridtrain",
        description="Train PyTorch models larger than one GPU's memory, and tune them.",
    )
    parser.add_argument("--version", action="version", version=f"hybridtrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    from hybridtrain.commands.train import add_train_command

    add_train_command(sub)

    from hybridtrain.commands.launch import add_launch_command

    add_launch_command(sub)

    from hybridtrain.commands.hpo import add_hpo_commands

    add_hpo_commands(sub)

    from hybridtrain.commands.jobs import add_service_commands

    add_service_commands(sub)

    from hybridtrain.commands.report import add_report_command

    add_report_command(sub)

    from hybridtrain.commands.checkpoint import add_checkpoint_command

    add_checkpoint_command(sub)

    from hybridtrain.commands.profile import add_profile_command

    add_profile_command(sub)

    from hybridtrain.commands.plan import add_planner_commands

    add_planner_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hybridtrain`` console script; returns the exit code."""
    _show_info_lines()
    # torch warns at import when numpy is missing (it is a dependency, but an environment may
    # lack it); nothing hybridtrain runs needs numpy, and a .npy data file says so itself.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    args: argparse.Namespace | None = None
    try:
        with raise_on_sigterm():  # SIGTERM during start-up or a command: one line, exit 143
            parser = build_parser()  # imports torch: seconds in which a Ctrl-C lands here
            args = parser.parse_args(argv)
            code: int = args.func(args)
    except KeyboardInterrupt:
        # A Ctrl-C no command caught (start-up, or a command without its own handling) is
        # one line, not a traceback; under torchrun rank 0 says it for the run.
        if os.environ.get("RANK", "0") == "0":
            print("interrupted: stopped by Ctrl-C", file=sys.stderr, flush=True)
        return 130
    except Terminated:
        if os.environ.get("RANK", "0") == "0" and "LOCAL_RANK" not in os.environ:
            when = " during start-up: nothing was done" if args is None else ""
            print(f"terminated (SIGTERM){when}", file=sys.stderr, flush=True)
        return 143
    return code


def _show_info_lines() -> None:
    # What the library says once at info level (DeepSpeed keys without effect, offload
    # mappings) reaches the terminal as "info: …" lines on stderr ("warning: …" for warnings).
    logger = logging.getLogger("hybridtrain")
    if not logger.handlers:
        handler = _StderrHandler()
        handler.setFormatter(_LevelFormatter())
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is now (tests and embedders swap it), not to the
    stream it first saw."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


class _LevelFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname.lower()}: {record.getMessage()}"


if __name__ == "__main__":
    sys.exit(main())
