"""``hybridtrain checkpoint export CKPT OUT``."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_checkpoint_command(sub: Any) -> None:
    """Register ``checkpoint`` (and its ``export``) on the top-level sub-parsers."""
    parser = sub.add_parser("checkpoint", help="work with training checkpoints",
                            description="Work with checkpoints written by `hybridtrain train` or "
                            "engine.save_checkpoint (sharded by any number of processes).")
    commands = parser.add_subparsers(dest="checkpoint_command", metavar="COMMAND", required=True)
    export = commands.add_parser(
        "export", help="write one consolidated model (safetensors)",
        description="Write the model of CKPT as one file in OUT: Hugging Face models (the run's config "
        "names model.name: hf:<type>) through save_pretrained, others as model.safetensors.")
    export.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory (…/checkpoints/step-N)")
    export.add_argument("out", metavar="OUT", help="output directory")
    export.add_argument("--config", default=None,
                        help="the run's config (default: config.json of the run directory)")
    export.add_argument("--overwrite", action="store_true",
                        help="replace what OUT holds (without it, an OUT that holds files is refused)")
    export.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    from hybridtrain.checkpoint.export import export
    from hybridtrain.checkpoint.layout import CheckpointError

    try:
        written = export(args.checkpoint, args.out, args.config, args.overwrite)
    except (CheckpointError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"wrote {written}")
    return 0
