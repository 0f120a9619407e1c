"""The training service's series on ``/metrics`` (next to the HPO service's).

Read from the storage at each scrape, like :mod:`hybridtrain.hpo.exporter`, so every
service process shows the same numbers. One scrape is one query.

==============================================  =====  ================================
series                                          type   labels
==============================================  =====  ================================
``hybridtrain_service_up``                      gauge  (1: storage read; 0: it failed)
``hybridtrain_service_jobs``                    gauge  ``state``
``hybridtrain_service_queue_length``            gauge
``hybridtrain_service_devices``                 gauge  ``kind`` (slots of this machine)
``hybridtrain_service_devices_busy``            gauge  ``kind``
``hybridtrain_service_job_running``             gauge  ``job_name``, ``backend`` (1 per job)
``hybridtrain_service_job_devices``             gauge  ``job_name`` (devices it holds)
``hybridtrain_service_job_restarts``            gauge  ``job_name``
``hybridtrain_service_job_queued_seconds``      gauge  ``job_name`` (time waiting so far)
==============================================  =====  ================================

The per-job label is ``job_name`` (Prometheus keeps ``job`` for the scrape job), as on the
training pods' series. Per-job series cover queued and running jobs, and finished ones for
:data:`FINISHED_KEEP_S` after they end (at most the last :data:`RECENT`): long enough for
every scrape and alert to see how a job ended, and the number of series stays bounded however
many jobs the storage has seen.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from hybridtrain.service.devices import Slots
from hybridtrain.service.states import ACTIVE, STATES, WAITING
from hybridtrain.service.store import JobStore

log = logging.getLogger(__name__)
PREFIX = "hybridtrain_service_"
#: Finished jobs that keep their per-job series, at most.
RECENT = 50
#: Seconds a finished job keeps its per-job series.
FINISHED_KEEP_S = 3600.0
#: Every series name this module exposes (the Grafana dashboard's test checks against it).
SERIES = tuple(PREFIX + name for name in (
    "up", "jobs", "queue_length", "devices", "devices_busy", "job_running", "job_devices",
    "job_restarts", "job_queued_seconds"))


class JobCollector:
    """Renders the jobs' current state at scrape time.

    Args:
        store: the job storage.
        slots: this machine's device slots.
        keep_finished_s: seconds a finished job keeps its per-job series.
    """

    def __init__(self, store: JobStore, slots: Slots, keep_finished_s: float = FINISHED_KEEP_S) -> None:
        self.store, self.slots, self.keep_finished_s = store, slots, keep_finished_s

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        try:
            families = self._families()
            up = 1.0
        except Exception as exc:  # noqa: BLE001 - storage down: say so, do not fail the scrape
            log.warning("/metrics: cannot read the job storage: %s", exc)
            families, up = [], 0.0
        yield GaugeMetricFamily(PREFIX + "up", "1 when this scrape read the job storage",
                                value=up)
        yield from families

    def _families(self) -> list[Any]:
        from prometheus_client.core import GaugeMetricFamily

        jobs = self.store.jobs()
        now = time.time()
        by_state = GaugeMetricFamily(PREFIX + "jobs", "Training jobs by state", labels=["state"])
        for state in STATES:
            by_state.add_metric([state], sum(j.state == state for j in jobs))
        queue = GaugeMetricFamily(PREFIX + "queue_length", "Jobs waiting for devices",
                                  value=sum(j.state in WAITING for j in jobs))
        kind = self.slots.kind
        total = GaugeMetricFamily(PREFIX + "devices", "Device slots of this machine",
                                  labels=["kind"])
        total.add_metric([kind], len(self.slots.ids))
        busy = GaugeMetricFamily(PREFIX + "devices_busy", "Device slots held by running jobs",
                                 labels=["kind"])
        busy.add_metric([kind], sum(len(j.devices) for j in jobs if j.state == "running"
                                    and j.spec.backend == "local"))
        running = GaugeMetricFamily(PREFIX + "job_running", "1 while the job runs",
                                    labels=["job_name", "backend"])
        devices = GaugeMetricFamily(PREFIX + "job_devices", "Devices the job holds",
                                    labels=["job_name"])
        restarts = GaugeMetricFamily(PREFIX + "job_restarts", "Restarts of the job so far",
                                     labels=["job_name"])
        waited = GaugeMetricFamily(PREFIX + "job_queued_seconds",
                                   "Seconds the queued job has waited", labels=["job_name"])
        finished = [j for j in jobs if j.state not in ACTIVE
                    and now - (j.finished_at or 0.0) <= self.keep_finished_s]
        finished.sort(key=lambda j: j.finished_at or 0.0)
        shown = [j for j in jobs if j.state in ACTIVE] + finished[-RECENT:]
        for job in shown:
            running.add_metric([job.name, job.spec.backend], float(job.state == "running"))
            devices.add_metric([job.name], len(job.devices) if job.state == "running" else 0)
            restarts.add_metric([job.name], job.restarts)
            waited.add_metric([job.name], now - job.queued_at if job.state in WAITING else 0.0)
        return [by_state, queue, total, busy, running, devices, restarts, waited]
