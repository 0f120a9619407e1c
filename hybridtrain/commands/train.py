"""``hybridtrain train`` and ``hybridtrain config``: the CLI side of training."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridtrain.terminate import Terminated

if TYPE_CHECKING:
    from hybridtrain.trainer import TrainSummary


def add_train_command(sub: Any) -> None:
    """Register ``train`` and ``config`` on the top-level sub-parsers."""
    train = sub.add_parser(
        "train",
        help="train the configured model (reference GPT on the embedded corpus by default)",
        description="Train the model a config file describes. Metrics go to OUTPUT_DIR/metrics.jsonl, "
        "checkpoints to OUTPUT_DIR/checkpoints; SIGTERM/Ctrl-C saves a checkpoint before exiting.",
    )
    train.add_argument("config", nargs="?", help="JSON/YAML config (DeepSpeed keys accepted); defaults when omitted")
    _add_overrides(train)
    train.add_argument("--resume", nargs="?", const=True, default=False, metavar="CHECKPOINT",
                       help="continue from CHECKPOINT, or from the newest one in train.output_dir when no path is "
                       "given (starts fresh when there is none); after a crash under --max-restarts the ranks resume "
                       "by themselves")
    train.add_argument("--overwrite", action="store_true",
                       help="start over in an output directory that has checkpoints: its checkpoints and metrics "
                       "are deleted first (without it such a start is refused)")
    train.add_argument("--output-dir", help="shortcut for --set train.output_dir=…")
    train.add_argument("--steps", type=int, help="shortcut for --set train.steps=…")
    train.add_argument("--data", help="text or token file to train on (shortcut for --set data.path=…)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("--metrics-port", type=int, metavar="PORT",
                       help="serve Prometheus metrics at http://127.0.0.1:PORT/metrics while training "
                       "(shortcut for --set train.metrics_port=…; each rank on PORT + its local rank; "
                       "train.metrics_host sets the address)")
    from hybridtrain.commands.launch import add_launch_options

    # --nproc-per-node N (or several nodes) starts N ranks through torchrun, each running
    # this same command without the placement options.
    add_launch_options(train)
    train.set_defaults(func=_train)

    config = sub.add_parser("config", help="show a resolved config, or the reference of every key",
                            description="Print the validated config (after --set overrides) as JSON, "
                            "or with --reference the documentation of every key.")
    config.add_argument("config", nargs="?", help="JSON/YAML config to resolve")
    _add_overrides(config)
    config.add_argument("--reference", action="store_true", help="print the config reference (Markdown)")
    config.add_argument("--plan", action="store_true",
                        help="print the training plan instead: blocks, what each technique does to them, who "
                        "runs a step, where the optimizer lives (the model is built on the meta device)")
    config.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="with --plan: plan for N processes (default: WORLD_SIZE, else 1)")
    config.set_defaults(func=_config)


def _add_overrides(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set optimizer.params.lr=3e-4 (repeatable)")


def _train(args: argparse.Namespace) -> int:
    if _wants_launch(args):
        return _launch_ranks(args)
    try:
        from hybridtrain.config import load_config
        from hybridtrain.trainer import Road, run_training

        cfg = load_config(args.config, _overrides(args))
        road: Road | None = None
        if cfg.precision_math == "deepspeed":  # DeepSpeed's bf16/fp16 math, built as the drop-in builds it
            from hybridtrain.deepspeed.building import prepare_with_deepspeed_math

            road = prepare_with_deepspeed_math
        summary = run_training(cfg, resume=args.resume, progress=not args.no_progress, overwrite=args.overwrite,
                               road=road)
    except (KeyboardInterrupt, Terminated) as exc:  # before training started, or a second one while saving
        # SIGTERM outside the steps (hybridtrain.terminate); under torchrun the launcher
        # says why it stopped the ranks (and which failed first).
        if os.environ.get("RANK", "0") == "0" and not (isinstance(exc, Terminated) and "LOCAL_RANK" in os.environ):
            how = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
            print(f"{how}: stopped without saving a checkpoint", file=sys.stderr)
        return 143 if isinstance(exc, Terminated) else 130
    except Exception as exc:  # noqa: BLE001 - every failure a user can cause ends in one line
        return _report_failure(exc)
    if os.environ.get("RANK", "0") != "0":
        return 130 if summary.interrupted else 0
    first = f"{summary.first_loss:.4f}" if summary.first_loss is not None else "-"
    last = f"{summary.last_loss:.4f}" if summary.last_loss is not None else "-"
    # Stopped by a signal: its line on stderr said so when it came; here how it ended.
    stopped = " (stopped early; its checkpoint is saved)" if summary.interrupted else ""
    print(f"summary: steps {summary.start_step}→{summary.steps}{stopped}, loss {first} → {last}, "
          f"{summary.tokens_per_s:,.0f} tokens/s, {memory_words(summary)}, skipped steps {summary.skipped_steps}")
    final = [f"loss={summary.last_loss}"] if summary.last_loss is not None else []
    if summary.eval_loss is not None:
        final.append(f"eval_loss={summary.eval_loss}")
    print(" ".join(final), flush=True)
    return 130 if summary.interrupted else 0


def memory_words(summary: TrainSummary) -> str:
    """The summary's memory figures, each saying what it measures. On CPU the peak is the
    process's resident set size, while ``device_memory_limit`` counts live tensor bytes:
    side by side without words, a user would take the limit for broken."""
    from hybridtrain.units import format_bytes

    limit = summary.device_memory_limit
    if summary.device.startswith("cuda"):
        under = f", device_memory_limit {format_bytes(limit)}" if limit is not None else ""
        return f"peak memory {summary.peak_memory_bytes / 2**30:.2f} GiB (allocated{under})"
    words = f"peak memory {summary.peak_memory_bytes / 2**30:.2f} GiB (process RSS)"
    if limit is not None and summary.peak_tensor_bytes is not None:
        words += (f", device_memory_limit {format_bytes(limit)} counts live tensor bytes: peak "
                  f"{format_bytes(summary.peak_tensor_bytes)}")
    return words


def _overrides(args: argparse.Namespace) -> list[str | tuple[str, Any]]:
    # The flags' values are typed already (argparse): taken as given, not re-read as YAML,
    # so a path keeps its newlines and a directory named "null" stays a name.
    overrides: list[str | tuple[str, Any]] = list(args.overrides)
    for key, value in (("train.output_dir", args.output_dir), ("train.steps", args.steps), ("data.path", args.data),
                       ("train.metrics_port", args.metrics_port)):
        if value is not None:
            overrides.append((key, value))
    return overrides


def _report_failure(exc: BaseException) -> int:
    """Print one ``error: …`` line for ``exc`` and return the exit code (2 = bad input);
    unexpected errors keep their traceback. Under torchrun the line also goes to the
    worker's error file, where the launcher reads which rank failed first."""
    from hybridtrain.errors import describe_failure

    failure = describe_failure(exc)
    if failure is None:
        raise exc
    message, code = failure
    rank = os.environ.get("RANK")
    print(f"error: {f'rank {rank}: ' if rank is not None and os.environ.get('WORLD_SIZE', '1') != '1' else ''}"
          f"{message}", file=sys.stderr, flush=True)
    from hybridtrain.parallel.worker import record_failure

    record_failure(exc)
    return code


def _wants_launch(args: argparse.Namespace) -> bool:
    inside_worker = "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ
    return not inside_worker and (args.nproc_per_node is not None or args.nnodes not in ("1", "1:1"))


def _launch_ranks(args: argparse.Namespace) -> int:
    from hybridtrain.commands.launch import spec_from_args
    from hybridtrain.config import explain_config
    from hybridtrain.run_lock import TOKEN_ENV, acquire
    from hybridtrain.trainer import check_output_dir

    # What every rank would refuse, refused once here before any rank starts. The
    # launcher owns the run directory for the whole launch, restarts included; its ranks
    # find its token in the lock (hybridtrain.run_lock).
    lock = None
    try:
        cfg, _ = explain_config(args.config, _overrides(args))  # the ranks say what keys did
        spec_from_args(args, module=True).validate()  # bad launch options: one line, nothing created
        if getattr(args, "node_rank", 0) == 0:
            lock = acquire(Path(cfg.train.output_dir))
            os.environ[TOKEN_ENV] = lock.token
        check_output_dir(cfg, args.resume, args.overwrite)
    except Exception as exc:  # noqa: BLE001 - one line, as in a worker
        if lock is not None:
            lock.release()
        return _report_failure(exc)
    try:
        return _launch_workers(args)
    finally:
        if lock is not None:
            lock.release()
        os.environ.pop(TOKEN_ENV, None)


def _launch_workers(args: argparse.Namespace) -> int:
    from hybridtrain.commands.launch import spec_from_args
    from hybridtrain.parallel.launch import launch

    worker = ["train", *([args.config] if args.config else [])]
    for item in args.overrides:
        worker += ["--set", item]
    for flag, value in (("--output-dir", args.output_dir), ("--steps", args.steps), ("--data", args.data),
                        ("--metrics-port", args.metrics_port)):
        worker += [flag, str(value)] if value is not None else []
    if args.resume:
        worker += ["--resume"] if args.resume is True else ["--resume", str(args.resume)]
    worker += ["--overwrite"] if args.overwrite else []
    worker += ["--no-progress"] if args.no_progress else []
    try:
        # Rank 0 says how a Ctrl-C/SIGTERM ended (the step it saved): the launcher stays quiet.
        return launch(spec_from_args(args, module=True), "hybridtrain", worker, announce_stop=False,
                      rounds_keep_apart=True)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _config(args: argparse.Namespace) -> int:
    from hybridtrain.config import ConfigError, explain_config
    from hybridtrain.config.reference import config_reference
    from hybridtrain.plan.resolve import check_optimizer

    if args.reference:
        print(config_reference())
        return 0
    try:
        cfg, applied = explain_config(args.config, args.overrides)
        check_optimizer(cfg)  # refuse exactly what initialize would
        if args.plan:
            from hybridtrain.training_inputs import plan_training

            print(json.dumps(plan_training(cfg, args.world_size).summary(), indent=2))
            return 0
    except (ConfigError, ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(cfg.model_dump(), indent=2))
    for item in applied:  # every DeepSpeed key that was not simply implemented
        print(f"deepspeed key {item.key}: {item.treatment} ({item.note})", file=sys.stderr)
    return 0
