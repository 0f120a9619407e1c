"""The service's per-job series leave /metrics a while after the job ends, so their number
stays bounded however many jobs the storage has seen."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hybridtrain.service.devices import parse_slots
from hybridtrain.service.exporter import RECENT, JobCollector
from hybridtrain.service.spec import load_job_spec
from hybridtrain.service.store import JobStore

pytest.importorskip("prometheus_client")


def _job_names(collector: JobCollector) -> set[str]:
    family = next(f for f in collector.collect() if f.name == "hybridtrain_service_job_running")
    return {sample.labels["job_name"] for sample in family.samples}


def test_finished_jobs_keep_their_series_for_a_while_and_at_most_recent(tmp_path: Path) -> None:
    store = JobStore(f"sqlite:///{tmp_path / 's.db'}")
    for i in range(RECENT + 2):
        spec = load_job_spec({"name": f"j{i}", "command": ["true"], "workdir": str(tmp_path)})
        store.submit(spec, str(tmp_path / f"j{i}"))
    for i in range(RECENT + 1):  # all but the last one end
        store.cancel(f"j{i}")
    slots = parse_slots("cpu:1")
    recent = _job_names(JobCollector(store, slots))
    assert len(recent) == RECENT + 1 and f"j{RECENT + 1}" in recent and "j0" not in recent
    time.sleep(0.05)
    # Past keep_finished_s only the waiting job keeps its series.
    assert _job_names(JobCollector(store, slots, keep_finished_s=0.01)) == {f"j{RECENT + 1}"}
