"""``hybridtrain profile CONFIG``: profile a few training steps of the configured model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_profile_command(sub: Any) -> None:
    """Register ``profile`` on the top-level sub-parsers."""
    parser = sub.add_parser(
        "profile",
        help="profile training steps: FLOPs, memory and time per module, the step's parts, MFU, a diagnosis",
        description="Build the model and engine a config describes and train STEPS steps on its data: the first "
        "is counted (forward/backward FLOPs and saved activations per module, live memory over time), the others "
        "timed with torch.profiler (the step split into forward, backward, device and host optimizer, transfer, "
        "communication and idle; time per module). Prints a table and writes profile.json, trace.json (Chrome "
        "trace) and memory.png to the output directory.",
    )
    parser.add_argument("config", nargs="?", help="JSON/YAML config (DeepSpeed keys accepted); defaults when omitted")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set model.overrides.n_layer=4 (repeatable)")
    parser.add_argument("--steps", type=int, default=5, metavar="N",
                        help="steps to run, at least 2: one counted, N-1 timed (default 5; the first timed step "
                             "also carries the profiler's start-up, so fewer steps overstate the step time)")
    parser.add_argument("-o", "--output-dir", metavar="DIR",
                        help="where profile.json, trace.json and memory.png go (default: <train.output_dir>/profile)")
    parser.add_argument("--json", action="store_true", help="print profile.json instead of the table")
    parser.set_defaults(func=_profile)


def _profile(args: argparse.Namespace) -> int:
    from hybridtrain.compose import check_autocast_math
    from hybridtrain.config import ConfigError, load_config

    if args.steps < 2:
        print(f"error: --steps {args.steps}: a profile needs at least 2 steps (one counted, the rest timed)",
              file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, args.overrides)
        check_autocast_math(cfg, "hybridtrain profile")  # before the model and data are built
        if args.output_dir and Path(args.output_dir).exists() and not Path(args.output_dir).is_dir():
            raise ValueError(f"-o {args.output_dir} is a file: give a directory for profile.json, trace.json "
                             "and memory.png")
        profile = _run(cfg, args.steps, args.output_dir)
    except (ConfigError, ValueError, ImportError, RuntimeError) as exc:
        # RuntimeError covers torch.OutOfMemoryError and a model that fails on the batch.
        print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 2
    if profile is not None:
        print(json.dumps(profile.to_dict(), indent=1) if args.json else profile.table(), flush=True)
    return 0


def _run(cfg: Any, steps: int, output_dir: str | None) -> Any:
    from hybridtrain.compose import initialize
    from hybridtrain.models.gpt import causal_lm_loss
    from hybridtrain.profiling.profiler import profile_engine

    # The CLI's own model and data, built exactly as `hybridtrain train` builds them.
    from hybridtrain.training_inputs import data_and_model, example_batch

    data, model = data_and_model(cfg, fits_host=True)
    engine = initialize(model, cfg, loss_fn=causal_lm_loss, example_batch=example_batch(cfg, data))
    engine.overlap_updates = True  # as `hybridtrain train` runs it
    batch = engine.local_batch(data.train_batch(0, engine.options.batch.global_batch))
    writer = engine.parallel.is_writer
    out = Path(output_dir) if output_dir else Path(cfg.train.output_dir) / "profile"
    profile = profile_engine(engine, batch, steps, out if writer else None)
    return profile if writer else None
