"""``hybridtrain report RUN_DIR [RUN_DIR …] [-o report.html]``."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_report_command(sub: Any) -> None:
    """Register ``report`` on the top-level sub-parsers."""
    parser = sub.add_parser(
        "report", help="one self-contained HTML page comparing training runs",
        description="Write one HTML page (plots embedded, no network resources) comparing the runs: "
        "loss and eval loss, learning rate, tokens/s, memory, the step-time breakdown, a summary "
        "table and the config keys whose values differ. Each RUN_DIR is a `hybridtrain train` "
        "output directory (metrics.jsonl, config.json, summary.json) or a metrics.jsonl file.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories to compare")
    parser.add_argument("-o", "--output", default="report.html", help="output file (default report.html)")
    parser.add_argument("--title", default=None, help="page title (default: the run names)")
    parser.set_defaults(func=_report)


def _report(args: argparse.Namespace) -> int:
    from hybridtrain.report.runs import ReportError

    try:
        from hybridtrain.report.html import write_report

        path = write_report(args.runs, args.output, args.title)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        if not (exc.name or "").startswith("matplotlib"):
            raise
        print("error: hybridtrain report draws its figures with matplotlib, which is not installed; "
              "pip install 'hybridtrain[report]'", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB, {len(args.runs)} run"
          f"{'s' if len(args.runs) != 1 else ''})")
    return 0
