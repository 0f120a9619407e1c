"""``hybridtrain report``: one self-contained HTML page comparing training runs (loss, eval
loss, learning rate, tokens/s, memory, the step-time breakdown, and how the configs
differ), from the run directories ``hybridtrain train`` writes."""

from __future__ import annotations

from hybridtrain.report.html import build_report, write_report
from hybridtrain.report.runs import ReportError, Run, config_differences, flatten, load_run

__all__ = ["ReportError", "Run", "build_report", "config_differences", "flatten", "load_run",
           "write_report"]
