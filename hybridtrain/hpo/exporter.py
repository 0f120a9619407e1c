"""``GET /metrics`` of ``hpo serve``: the service's own state as Prometheus text.

Every value is read from the storage when Prometheus scrapes (a custom collector on a
private ``CollectorRegistry``, as :mod:`hybridtrain.monitoring.prometheus` does for the
training job), so the page is always current, agrees with ``hpo status`` and the REST API
whichever controllers did the work, and costs nothing between scrapes. One scrape is
three SQL queries, whatever the number of experiments:

=============================================  =========  ================================
series                                         type       labels
=============================================  =========  ================================
``hybridtrain_hpo_up``                         gauge      (1: storage read; 0: it failed)
``hybridtrain_hpo_experiments``                gauge      ``state``
``hybridtrain_hpo_trials``                     gauge      ``experiment``, ``state``
``hybridtrain_hpo_trial_duration_seconds``     histogram  ``experiment``, ``state``
``hybridtrain_hpo_leases``                     gauge      ``experiment``, ``state``
``hybridtrain_hpo_lease_renewals_total``       counter    ``experiment``
=============================================  =========  ================================

Trial states are those of ``hpo status`` plus two: ``complete``, ``pruned``, ``failed``
(failed attempts) and ``interrupted`` count Optuna trials (attempts); ``running``,
``waiting`` and ``cancelled`` count slots. Lease renewals are counted in the process
that renews them (:data:`hybridtrain.hpo.leases.RENEWALS`); the storage keeps no count,
so this counter covers controllers inside the server process only.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from hybridtrain.compat import optuna_rdb_models, prometheus_float
from hybridtrain.hpo.leases import RENEWALS, RenewalCounter
from hybridtrain.hpo.records import EXPERIMENTS, SLOTS

if TYPE_CHECKING:
    from hybridtrain.hpo.experiments import ExperimentStore

log = logging.getLogger(__name__)

PREFIX = "hybridtrain_hpo_"
EXPERIMENT_STATES = ("running", "stopping", "stopped", "interrupted", "succeeded", "failed")
TRIAL_STATES = ("complete", "pruned", "failed", "interrupted", "running", "waiting",
                "cancelled")
FINISHED_STATES = ("complete", "pruned", "failed", "interrupted")
_SLOT_STATES = {"running": "running", "pending": "waiting", "cancelled": "cancelled"}
#: Trial-duration buckets (seconds): a 1 s synthetic trial up to a day of training.
DURATION_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
                    7200.0, 14400.0, 43200.0, 86400.0)

HELP = {
    "up": "1 when this scrape read the HPO storage, 0 when it could not (then the other "
          "series are left out)",
    "experiments": "HPO experiments by state",
    "trials": "Trials of an experiment by state: complete/pruned/failed/interrupted count "
              "finished attempts (Optuna trials), running/waiting/cancelled count slots",
    "trial_duration_seconds": "Wall time of the finished trials of an experiment, by final "
                              "state (start to end as recorded in the storage)",
    "leases": "Slot leases of running trials: held (renewed in time) or expired (their "
              "controller stopped renewing; another controller will take the slot over)",
    "lease_renewals_total": "Slot leases renewed by controllers running in this server "
                            "process (per server process, from 0 at its start; workers "
                            "started by hpo serve are processes of their own and renew "
                            "theirs uncounted here)",
}


def _finished_trials(engine: Any, names: list[str]) -> list[tuple[str, str, float | None]]:
    """``(experiment, state, duration or None)`` of every trial of ``names``.

    Read from Optuna's tables in one query (``get_trials`` would load every parameter and
    intermediate value of every trial at each scrape). States as :mod:`experiments` names
    them, with ``fail`` split into ``failed`` and ``interrupted``.
    """
    import sqlalchemy as sa
    models = optuna_rdb_models()

    trials, studies = models.TrialModel.__table__, models.StudyModel.__table__
    attrs = models.TrialUserAttributeModel.__table__
    query = (sa.select(studies.c.study_name, trials.c.state, trials.c.datetime_start,
                       trials.c.datetime_complete, attrs.c.value_json)
             .select_from(trials.join(studies, trials.c.study_id == studies.c.study_id)
                          .outerjoin(attrs, sa.and_(attrs.c.trial_id == trials.c.trial_id,
                                                    attrs.c.key == "interrupted")))
             .where(studies.c.study_name.in_(names)))
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    out = []
    for name, state, start, end, interrupted in rows:
        state_name = getattr(state, "name", str(state)).lower()
        if state_name == "fail":
            flagged = interrupted is not None and json.loads(interrupted) not in (False, None)
            state_name = "interrupted" if flagged else "failed"
        if state_name not in FINISHED_STATES:
            continue  # running/waiting trials are counted by their slots
        duration = (end - start).total_seconds() if start and end else None
        out.append((name, state_name, duration))
    return out


class HPOCollector:
    """Renders the storage's current state at scrape time.

    Args:
        store: the experiments' storage.
        renewals: the process's lease-renewal counter.
    """

    def __init__(self, store: ExperimentStore, renewals: RenewalCounter = RENEWALS) -> None:
        self.store, self.renewals = store, renewals

    def describe(self) -> list[Any]:
        return []  # names are not known before a scrape; nothing to check at register

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        try:
            families = self._families()
        except Exception as exc:  # storage down, locked past its timeout, schema too old
            log.warning("/metrics: cannot read the HPO storage: %s", exc)
            families = []
            up = 0.0
        else:
            up = 1.0
        yield GaugeMetricFamily(PREFIX + "up", HELP["up"], value=up)
        yield from families

    def _families(self) -> list[Any]:
        import sqlalchemy as sa
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        engine = self.store.records.engine
        with engine.connect() as conn:
            experiments = conn.execute(sa.select(EXPERIMENTS.c.name, EXPERIMENTS.c.state,
                                                 EXPERIMENTS.c.spec_json)
                                       .order_by(EXPERIMENTS.c.created_at)).all()
            slots = conn.execute(sa.select(SLOTS.c.experiment, SLOTS.c.state,
                                           SLOTS.c.lease_expires)
                                 .where(SLOTS.c.state.in_(tuple(_SLOT_STATES)))).all()
        names = [e.name for e in experiments]
        finished = _finished_trials(engine, names) if names else []
        now = time.time()

        by_state = Counter(e.state for e in experiments)
        exp_family = GaugeMetricFamily(PREFIX + "experiments", HELP["experiments"],
                                       labels=["state"])
        for state in (*EXPERIMENT_STATES, *sorted(set(by_state) - set(EXPERIMENT_STATES))):
            exp_family.add_metric([state], by_state[state])

        counts: Counter[tuple[str, str]] = Counter()
        durations: dict[tuple[str, str], list[float]] = defaultdict(list)
        for name, state, duration in finished:
            counts[name, state] += 1
            if duration is not None:
                durations[name, state].append(duration)
        leases: Counter[tuple[str, str]] = Counter()
        for row in slots:
            counts[row.experiment, _SLOT_STATES[row.state]] += 1
            if row.state == "running":
                expired = row.lease_expires is None or row.lease_expires < now
                leases[row.experiment, "expired" if expired else "held"] += 1

        trials = GaugeMetricFamily(PREFIX + "trials", HELP["trials"],
                                   labels=["experiment", "state"])
        histogram = HistogramMetricFamily(PREFIX + "trial_duration_seconds",
                                          HELP["trial_duration_seconds"],
                                          labels=["experiment", "state"])
        lease_family = GaugeMetricFamily(PREFIX + "leases", HELP["leases"],
                                         labels=["experiment", "state"])
        renewed = self.renewals.snapshot()
        renewals = CounterMetricFamily(PREFIX + "lease_renewals_total",
                                       HELP["lease_renewals_total"], labels=["experiment"])
        for name in names:
            for state in TRIAL_STATES:
                trials.add_metric([name, state], counts[name, state])
            for state in FINISHED_STATES:
                values = durations.get((name, state), [])
                histogram.add_metric([name, state], _buckets(values), sum(values))
            for state in ("held", "expired"):
                lease_family.add_metric([name, state], leases[name, state])
            renewals.add_metric([name], renewed.get(name, 0))
        return [exp_family, trials, histogram, lease_family, renewals]


def _buckets(values: list[float]) -> list[tuple[str, float]]:
    """Cumulative ``(le, count)`` pairs of ``values``, ending with ``+Inf``."""
    ordered = sorted(values)
    out, i = [], 0
    for bound in DURATION_BUCKETS:
        while i < len(ordered) and ordered[i] <= bound:
            i += 1
        out.append((prometheus_float(bound), float(i)))
    out.append(("+Inf", float(len(ordered))))
    return out


def metrics_registry(store: ExperimentStore) -> Any:
    """A private registry holding only the HPO collector (nothing else of the process).

    Raises:
        ImportError: ``prometheus_client`` is not installed.
    """
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(HPOCollector(store))
    return registry
