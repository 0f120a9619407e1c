"""Serve a training job's metrics as Prometheus text at ``http://HOST:PORT/metrics``.

The training thread hands over one snapshot per step (a new dict replacing the old one, no
lock, no device sync); ``prometheus_client``'s own HTTP thread renders whichever snapshot is
current when a scrape arrives, so a scrape always sees the values of one single step. The
registry is private (not ``prometheus_client``'s global one), so nothing else in the process
leaks into the page and several exporters can live in one process (tests).

Names, help texts and labels are :mod:`hybridtrain.monitoring.metric_names`; every series
carries ``rank``. With several processes each rank serves its own page on
``PORT + LOCAL_RANK`` (Prometheus scrapes every rank; ``sum``/``max by (rank)`` aggregate).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from hybridtrain.monitoring.metric_names import (
    COUNTERS,
    MEMORY_KINDS,
    METRICS,
    STEP_PARTS,
    TRANSFER_KINDS,
)

Key = tuple[str, str | None]
"""(metric name, value of its second label or None)."""

RECORD_FIELDS: dict[str, Key] = {
    "step": ("hybridtrain_step", None),
    "loss": ("hybridtrain_loss", None),
    "eval_loss": ("hybridtrain_eval_loss", None),
    "lr": ("hybridtrain_learning_rate", None),
    "loss_scale": ("hybridtrain_loss_scale", None),
    "skipped_steps": ("hybridtrain_skipped_steps_total", None),
    "tokens_per_s": ("hybridtrain_tokens_per_second", None),
    "samples_per_s": ("hybridtrain_samples_per_second", None),
    "tflops": ("hybridtrain_tflops", None),
    "mfu": ("hybridtrain_mfu", None),
    "forward_s": ("hybridtrain_step_seconds", "forward"),
    "backward_s": ("hybridtrain_step_seconds", "backward"),
    "forward_backward_interleaved_s": ("hybridtrain_step_seconds", "interleaved"),
    "step_s": ("hybridtrain_step_seconds", "optimizer"),
    "transfer_s": ("hybridtrain_step_seconds", "transfer"),
    "communication_s": ("hybridtrain_step_seconds", "communication"),
    "host_optimizer_s": ("hybridtrain_step_seconds", "host_optimizer"),
    "data_s": ("hybridtrain_step_seconds", "data"),
    "step_time_s": ("hybridtrain_step_seconds", "total"),
    "memory_allocated_bytes": ("hybridtrain_device_memory_bytes", "allocated"),
    "memory_reserved_bytes": ("hybridtrain_device_memory_bytes", "reserved"),
    "peak_memory_bytes": ("hybridtrain_device_memory_bytes", "peak"),
    "peak_memory_reserved_bytes": ("hybridtrain_device_memory_bytes", "peak_reserved"),
    "alloc_retries": ("hybridtrain_device_alloc_retries_total", None),
    "ooms": ("hybridtrain_device_ooms_total", None),
    "pinned_host_bytes": ("hybridtrain_pinned_host_bytes", None),
    "transfer_bytes": ("hybridtrain_transfer_bytes", None),  # an object: one series per kind
    "checkpoint_s": ("hybridtrain_checkpoint_seconds", None),
    "checkpoint_bytes": ("hybridtrain_checkpoint_bytes", None),
    "restarts": ("hybridtrain_restarts_total", None),
}
"""metrics.jsonl field → the series that shows it (the same number, so the two agree)."""

DEFAULTS: dict[Key, float] = {
    ("hybridtrain_loss_scale", None): 1.0,
    ("hybridtrain_skipped_steps_total", None): 0.0,
    ("hybridtrain_device_alloc_retries_total", None): 0.0,
    ("hybridtrain_device_ooms_total", None): 0.0,
    ("hybridtrain_pinned_host_bytes", None): 0.0,
    ("hybridtrain_restarts_total", None): 0.0,
}
"""Values shown until a record says otherwise (metrics.jsonl leaves these fields out while
they are at their resting value: no fp16, nothing skipped, no CUDA allocator)."""

_SECOND_LABEL = {"hybridtrain_step_seconds": ("part", STEP_PARTS),
                 "hybridtrain_device_memory_bytes": ("kind", MEMORY_KINDS),
                 "hybridtrain_transfer_bytes": ("kind", TRANSFER_KINDS)}


def snapshot_of(record: Mapping[str, Any]) -> dict[Key, float]:
    """The series values a metrics.jsonl record sets (unknown and non-numeric fields ignored)."""
    out: dict[Key, float] = {}
    for kind, nbytes in (record.get("transfer_bytes") or {}).items():  # one object, a series per kind
        if kind in TRANSFER_KINDS:
            out[("hybridtrain_transfer_bytes", kind)] = float(nbytes)
    for field, value in record.items():
        key = RECORD_FIELDS.get(field)
        if key is not None and isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = float(value)
    return out


class MetricsServer:
    """A ``/metrics`` endpoint for one rank.

    Args:
        host / port: where to listen (``port`` already includes the local-rank offset).
        rank: the value of every series' ``rank`` label.

    Raises:
        OSError: the address cannot be bound (in use, not local).
        ImportError: ``prometheus_client`` is not installed.
    """

    def __init__(self, host: str, port: int, rank: int) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self.host, self.port, self.rank = host, port, str(rank)
        self._values: dict[Key, float] = dict(DEFAULTS)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = self._server.server_port  # the real one when 0 was asked for
        self._closed = threading.Event()

    @property
    def url(self) -> str:
        """``http://host:port/metrics``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def update(self, record: Mapping[str, Any]) -> None:
        """Show ``record``'s values from now on (other series keep theirs). Cheap: one
        dict merge; the text is rendered only when scraped."""
        self._values = {**self._values, **snapshot_of(record)}

    def values(self) -> dict[Key, float]:
        """The current snapshot (for tests and the benchmark)."""
        return dict(self._values)

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class _Collector:
    """Renders the server's current snapshot at scrape time (on the HTTP thread)."""

    def __init__(self, server: MetricsServer) -> None:
        self._server = server

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        values = self._server._values  # one reference read: a consistent snapshot
        rank = self._server.rank
        for name, help_text in METRICS.items():
            second = _SECOND_LABEL.get(name)
            labels = ["rank", second[0]] if second else ["rank"]
            family = (CounterMetricFamily(name, help_text, labels=labels) if name in COUNTERS
                      else GaugeMetricFamily(name, help_text, labels=labels))
            for label in second[1] if second else (None,):
                value = values.get((name, label))
                if value is not None and not math.isnan(value):
                    family.add_metric([rank, label] if label else [rank], value)
            if family.samples:
                yield family
