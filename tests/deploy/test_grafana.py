"""The Grafana dashboard (deploy/grafana/hybridtrain.json) queries only metric names the
training job and the training service expose, shows every one of them, and is a well-formed dashboard."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "hybridtrain.json"

try:
    from hybridtrain.monitoring.metric_names import METRICS as _EXPOSED

    EXPOSED = set(_EXPOSED)
except ImportError:  # pragma: no cover - before hybridtrain.monitoring existed
    # Mirrors hybridtrain/monitoring/metric_names.py (METRICS), the names a training job exposes.
    EXPOSED = {
        "hybridtrain_step", "hybridtrain_loss", "hybridtrain_eval_loss", "hybridtrain_learning_rate",
        "hybridtrain_loss_scale", "hybridtrain_skipped_steps_total", "hybridtrain_tokens_per_second",
        "hybridtrain_samples_per_second", "hybridtrain_tflops", "hybridtrain_mfu", "hybridtrain_step_seconds",
        "hybridtrain_device_memory_bytes", "hybridtrain_device_alloc_retries_total",
        "hybridtrain_device_ooms_total", "hybridtrain_pinned_host_bytes", "hybridtrain_checkpoint_seconds",
        "hybridtrain_checkpoint_bytes", "hybridtrain_restarts_total",
    }
try:  # the training service's series (hybridtrain serve's /metrics)
    from hybridtrain.service.exporter import SERIES as _SERVICE

    EXPOSED |= set(_SERVICE)
except ImportError:  # pragma: no cover - without the service's dependencies
    pass
# Label values the job sets (hybridtrain.monitoring.metric_names.STEP_PARTS / MEMORY_KINDS).
STEP_PARTS = {"forward", "backward", "interleaved", "optimizer", "transfer", "communication", "host_optimizer",
              "data", "total"}
MEMORY_KINDS = {"allocated", "reserved", "peak"}
# Labels a series can carry: the job's own, and those Prometheus/the PodMonitor add.
LABELS = {"rank", "part", "kind", "namespace", "pod", "container", "job", "instance", "endpoint",
          "job_name", "replica", "state", "backend"}

_FUNCTIONS = {
    "abs", "absent", "avg_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min", "delta",
    "deriv", "exp", "floor", "histogram_quantile", "idelta", "increase", "irate", "label_replace",
    "last_over_time", "ln", "log2", "max_over_time", "min_over_time", "predict_linear", "rate", "resets",
    "round", "scalar", "sort", "sort_desc", "sqrt", "time", "timestamp", "vector", "quantile_over_time",
    "sum_over_time", "count_over_time", "label_values",
}
_AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
                 "bottomk", "topk", "quantile"}
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
             "unless", "offset"}


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows hold their panels
    return out


def _queries(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in _panels(dashboard) for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            exprs.append(query)
    return exprs


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (or a Grafana ``label_values(…)`` query) selects."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range selectors and durations
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"label_values\s*\(([^,()]*),[^)]*\)", r" \1 ", text)  # label_values(metric, label)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word = match.group(0)
        following = text[match.end():].lstrip()
        if following.startswith("(") and (word in _FUNCTIONS or word in _AGGREGATIONS):
            continue
        if word in _KEYWORDS or word.startswith("$") or text[max(0, match.start() - 1)] == "$":
            continue
        if re.fullmatch(r"\d*[eE]\d+|[0-9.]+|Inf|NaN|inf|nan", word):
            continue
        names.add(word)
    return names


def test_metric_name_extraction() -> None:
    assert metric_names('max by (job_name) (increase(hybridtrain_x_total{a="b,}", c=~"$d"}[5m])) * 60') == {
        "hybridtrain_x_total"}
    assert metric_names('label_values(hybridtrain_step{namespace="$namespace"}, job_name)') == {"hybridtrain_step"}
    assert metric_names("avg(a) / on(rank) group_left b + sum without (kind) (c)") == {"a", "b", "c"}


def test_every_query_names_an_exposed_metric_and_every_metric_is_shown() -> None:
    dashboard = _dashboard()
    used: set[str] = set()
    for expr in _queries(dashboard):
        names = metric_names(expr)
        assert names, expr
        unknown = names - EXPOSED
        assert not unknown, f"{expr}: {sorted(unknown)} not exposed by the training job"
        used |= names
        for label, value in re.findall(r'(\w+)\s*!?=~?\s*"([^"]*)"', expr):
            assert label in LABELS, f"{expr}: unknown label {label}"
            if label == "part" and not value.startswith("$"):
                assert set(value.split("|")) <= STEP_PARTS, expr
            if label == "kind" and not value.startswith("$"):
                assert set(value.split("|")) <= MEMORY_KINDS, expr
        for label in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
            assert {x.strip() for x in label.split(",")} <= LABELS, expr
        for counter in names & {n for n in EXPOSED if n.endswith("_total")}:
            # a counter is read as it is (max) or through increase/rate
            assert re.search(rf"(increase|rate|max)\b[^;]*{counter}", expr), expr
    assert used == EXPOSED, f"not on the dashboard: {sorted(EXPOSED - used)}"


def test_dashboard_is_well_formed() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "job", "rank"} <= variables
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0
        if panel["type"] == "row":
            continue
        assert panel["type"] in {"timeseries", "stat", "gauge", "table", "bargauge"}
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids))
        for target in panel["targets"]:
            for var in re.findall(r"\$(\w+)", target["expr"]):
                assert var in variables or var.startswith("__"), (panel["title"], var)
    # panels do not overlap
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        g = panel["gridPos"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, panel["title"]
        cells |= area
