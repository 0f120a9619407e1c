"""``hybridtrain hpo …`` commands.

Nothing heavy is imported here at module level (Optuna, FastAPI, matplotlib load inside
the command functions), so ``hybridtrain --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hybridtrain.hpo.errors import HPOError
from hybridtrain.server.errors import ServerError

_STORAGE_HELP = "storage URL (default: $HYBRIDTRAIN_HPO_STORAGE or sqlite:///hpo.db)"


def _errors_to_exit(func: Callable[[argparse.Namespace], int]) -> Callable[..., int]:
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except ServerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    wrapper.__doc__ = func.__doc__
    return wrapper


def _load_spec_arg(args: argparse.Namespace) -> Any:
    from hybridtrain.hpo.spec import load_spec

    if Path(args.spec).is_file() or args.spec.endswith((".yaml", ".yml", ".json")):
        notes: list[str] = []
        spec = load_spec(args.spec, notes)
        for note in notes:  # a Katib Experiment's translation: what it ignored or renamed
            print(f"info: {note}", file=sys.stderr)
        return spec
    # Not a file: the name of a stored experiment whose spec a worker joins.
    from hybridtrain.hpo.experiments import ExperimentStore

    return ExperimentStore(args.storage).spec(args.spec)


def _run_controller(args: argparse.Namespace, live: bool) -> int:
    from hybridtrain.hpo.controller import Controller
    from hybridtrain.hpo.experiments import ExperimentStore

    spec = _load_spec_arg(args)
    table = None
    interactive = live and sys.stdout.isatty()
    controller = Controller(spec, args.storage,
                            on_event=None if interactive else lambda line: print(line, flush=True))
    store = ExperimentStore(controller.url)
    if interactive:
        from hybridtrain.hpo.table import LiveTable

        table = LiveTable(store, spec.name)
        table.start()
    try:
        # A service manager's SIGTERM gets the same clean stop as Ctrl-C.
        record = controller.run(stop_signals=(signal.SIGINT, signal.SIGTERM))
    except KeyboardInterrupt:
        print(f"interrupted; resume with: hybridtrain hpo run {args.spec}", file=sys.stderr)
        return 130
    except ServerError:
        raise  # bad spec or storage gone: one line from _errors_to_exit, nothing to record
    except Exception as exc:  # noqa: BLE001 - a dead worker must not leave its experiment "running"
        return _worker_died(store, spec.name, exc)
    finally:
        if table is not None:
            table.stop()
    status = store.status(spec.name)
    print(json.dumps(status))
    return 0 if record.state in ("succeeded", "stopped") else 1


def _worker_died(store: Any, name: str, exc: Exception) -> int:
    """Record the experiment as failed with the reason (when the storage still answers)
    and say it in one line; exit code 1."""
    import socket

    reason = f"controller on {socket.gethostname()} died: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    try:
        store.records.finish(name, "failed", reason)
    except Exception as also:  # noqa: BLE001 - the storage itself is gone: nothing can be recorded
        reason += f" (not recorded: {type(also).__name__})"
    print(f"error: experiment {name!r}: {reason}", file=sys.stderr)
    return 1


@_errors_to_exit
def cmd_run(args: argparse.Namespace) -> int:
    """Run an experiment to the end (resumes it when it is already stored)."""
    return _run_controller(args, live=True)


@_errors_to_exit
def cmd_worker(args: argparse.Namespace) -> int:
    """Join an experiment as one more controller (same storage, any machine)."""
    return _run_controller(args, live=False)


def _print(data: Any, as_json: bool, text: str) -> None:
    print(json.dumps(data) if as_json else text)


@_errors_to_exit
def cmd_status(args: argparse.Namespace) -> int:
    """Print an experiment's state and trial counts."""
    from hybridtrain.hpo.experiments import ExperimentStore

    status = ExperimentStore(args.storage).status(args.name)
    counts = " ".join(f"{k}={v}" for k, v in status["trials"].items())
    _print(status, args.json, f"{status['name']}: {status['state']} ({status['reason']}) "
                              f"{counts}")
    return 0


@_errors_to_exit
def cmd_best(args: argparse.Namespace) -> int:
    """Print the best trial's value and parameters."""
    from hybridtrain.hpo.experiments import ExperimentStore

    best = ExperimentStore(args.storage).best(args.name)
    _print(best, args.json, f"trial {best['trial']}: value={best['value']} "
                            f"params={json.dumps(best['params'])}")
    return 0


@_errors_to_exit
def cmd_list(args: argparse.Namespace) -> int:
    """List the experiments of the storage."""
    from hybridtrain.hpo.experiments import ExperimentStore

    items = ExperimentStore(args.storage).list_experiments()
    lines = [f"{s['name']}\t{s['state']}\t" + " ".join(f"{k}={v}" for k, v in s["trials"].items())
             for s in items]
    _print(items, args.json, "\n".join(lines) if lines else "no experiments")
    return 0


@_errors_to_exit
def cmd_stop(args: argparse.Namespace) -> int:
    """Stop an experiment's trials on every controller; `hpo run` resumes it."""
    from hybridtrain.hpo.experiments import ExperimentStore

    status = ExperimentStore(args.storage).stop(args.name)
    print(f"{args.name}: {status['state']}")
    return 0


@_errors_to_exit
def cmd_report(args: argparse.Namespace) -> int:
    """Write plots of an experiment (PNG or HTML) to a directory."""
    from hybridtrain.hpo.experiments import ExperimentStore
    from hybridtrain.hpo.plots import write_report

    store = ExperimentStore(args.storage)
    out = Path(args.out or f"hpo-report-{args.name}")
    for path in write_report(store.study(args.name), out, args.format):
        print(path)
    return 0


@_errors_to_exit
def cmd_export_katib(args: argparse.Namespace) -> int:
    """Write the experiment as a Katib Experiment (YAML) whose trials run in containers."""
    import yaml

    from hybridtrain.hpo.katib_export import spec_to_katib

    doc = spec_to_katib(_load_spec_arg(args), image=args.image, namespace=args.namespace)
    text = yaml.safe_dump(doc, sort_keys=False, width=100)
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        try:
            Path(args.output).write_text(text)
        except OSError as exc:
            raise HPOError(f"cannot write {args.output!r}: {exc.strerror}") from None
        print(f"wrote {args.output}: kubectl apply -f {args.output}", file=sys.stderr)
    return 0


@_errors_to_exit
def cmd_serve(args: argparse.Namespace) -> int:
    """Serve the REST API and the optuna-dashboard."""
    from hybridtrain.hpo.server import serve

    return serve(host=args.host, port=args.port, storage=args.storage,
                 token_file=Path(args.token_file) if args.token_file else None,
                 metrics_public=args.metrics_public)


def add_hpo_commands(sub: Any) -> None:
    """Register ``hpo`` and its sub-commands on the top-level ``sub`` parsers.

    Args:
        sub: the ``argparse`` sub-parsers object of the ``hybridtrain`` parser.
    """
    hpo = sub.add_parser("hpo", help="hyperparameter optimization (Katib-style, on Optuna)",
                         description="Hyperparameter-optimization experiments.")
    cmds = hpo.add_subparsers(dest="hpo_command", metavar="HPO_COMMAND", required=True)

    def add(name: str, func: Callable[..., int], help_text: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = cmds.add_parser(name, help=help_text,
                                                     description=help_text)
        p.add_argument("--storage", default=None, help=_STORAGE_HELP)
        p.set_defaults(func=func)
        return p

    add("run", cmd_run, "run an experiment to the end, showing a live table; resumable "
        "by running it again").add_argument("spec", help="experiment spec (YAML/JSON)")
    add("worker", cmd_worker, "join an experiment as one more controller").add_argument(
        "spec", help="experiment spec file, or the name of a stored experiment")
    for name, func, help_text in (("status", cmd_status, "state and trial counts"),
                                  ("best", cmd_best, "best trial's value and parameters")):
        p = add(name, func, help_text)
        p.add_argument("name", help="experiment name")
        p.add_argument("--json", action="store_true", help="print JSON")
    add("list", cmd_list, "list experiments").add_argument("--json", action="store_true",
                                                           help="print JSON")
    add("stop", cmd_stop, "stop an experiment (resumable)").add_argument("name")
    p = add("report", cmd_report, "plots: history, parallel coordinates, importances, "
            "intermediate values")
    p.add_argument("name", help="experiment name")
    p.add_argument("--out", default=None, help="output directory (default hpo-report-NAME)")
    p.add_argument("--format", choices=("png", "html"), default="png")
    p = add("export-katib", cmd_export_katib, "write the experiment as a Katib "
            "kubeflow.org/v1beta1 Experiment, to run it on a Kubernetes cluster")
    p.add_argument("spec", help="experiment spec file, or the name of a stored experiment")
    p.add_argument("-o", "--output", default=None, help="output file (default: stdout)")
    p.add_argument("--image", default="hybridtrain:latest",
                   help="container image of the trials (default hybridtrain:latest)")
    p.add_argument("--namespace", default=None, help="Kubernetes namespace of the Experiment")
    p = add("serve", cmd_serve, "serve the REST API (/v1), the dashboard (/dashboard) and "
            "Prometheus metrics (/metrics)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--token-file", default=None,
                   help="bearer token file (default: $HYBRIDTRAIN_HPO_TOKEN, else "
                        "~/.config/hybridtrain/hpo-token, created on first start)")
    p.add_argument("--metrics-public", action="store_true",
                   help="serve the Prometheus page /metrics without the token (read-only: "
                        "experiment names and counts; default: the token is needed)")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``hpo`` commands without the rest of the CLI (``python -m hybridtrain.hpo``)."""
    parser = argparse.ArgumentParser(prog="python -m hybridtrain.hpo")
    sub = parser.add_subparsers(dest="command", required=True)
    add_hpo_commands(sub)
    args = parser.parse_args(["hpo", *(sys.argv[1:] if argv is None else argv)])
    code: int = args.func(args)
    return code
