"""``GET /metrics`` of ``hpo serve`` (issue 10, item 1): the numbers agree with the
experiments' records, the page needs the token unless ``--metrics-public``, and it is
read-only and bodyless whatever the auth setting."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from hybridtrain.hpo import exporter
from hybridtrain.hpo.api import create_app
from hybridtrain.hpo.experiments import ExperimentStore, run_experiment
from hybridtrain.hpo.leases import RENEWALS
from tests.hpo.conftest import PY, branin_command, serve_process
from tests.hpo.test_api_limits import _call

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = pytest.mark.timeout(120)
TOKEN = "t" * 32
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` of a Prometheus text page."""
    out = {}
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("hybridtrain_hpo_"), family.name
        for s in family.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def _value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[name, tuple(sorted(labels.items()))]


@pytest.fixture
def finished_experiments(sqlite_url: str, make_spec: Any) -> ExperimentStore:
    """Two experiments run to the end in this process: one succeeds, one fails."""
    # Trials of ~0.6 s, so the heartbeat (every 0.25 s) renews leases in this process.
    run_experiment(make_spec(max_trials=3, trial={"command": branin_command(2, 0.3)}),
                   sqlite_url)
    run_experiment(make_spec(name="broken", max_trials=2, parallel_trials=1,
                             max_failed_trials=0,
                             trial={"command": f"{PY} -S -c 'raise SystemExit(3)'"}),
                   sqlite_url)
    return ExperimentStore(sqlite_url)


def test_metrics_agree_with_the_records(finished_experiments: ExperimentStore) -> None:
    store = finished_experiments
    client = TestClient(create_app(store, TOKEN, launcher=None, dashboard=False))
    r = client.get("/metrics", headers=AUTH)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = _samples(r.text)
    assert _value(samples, "hybridtrain_hpo_up") == 1

    states = Counter(e.state for e in store.records.experiments())
    assert states == {"succeeded": 1, "failed": 1}
    for state in exporter.EXPERIMENT_STATES:
        assert _value(samples, "hybridtrain_hpo_experiments", state=state) == states[state]

    for name in ("branin", "broken"):
        status = store.status(name)
        trials = store.trials(name)
        by_state = Counter(t["state"] for t in trials)
        expected = {"complete": status["trials"]["complete"],
                    "pruned": status["trials"]["pruned"],
                    "failed": status["trials"]["failed"],
                    "interrupted": by_state["interrupted"],
                    "running": status["trials"]["running"],
                    "waiting": status["trials"]["waiting"],
                    "cancelled": store.records.slot_counts(name)["cancelled"]}
        got = {s: _value(samples, "hybridtrain_hpo_trials", experiment=name, state=s)
               for s in exporter.TRIAL_STATES}
        assert got == expected, name
        for state in exporter.FINISHED_STATES:
            mine = [t for t in trials if t["state"] == ("fail" if state == "failed" else state)]
            seconds = [(datetime.fromisoformat(t["completed"])
                        - datetime.fromisoformat(t["started"])).total_seconds() for t in mine]
            labels = {"experiment": name, "state": state}
            hist = "hybridtrain_hpo_trial_duration_seconds"
            assert _value(samples, f"{hist}_count", **labels) == len(mine)
            assert _value(samples, f"{hist}_sum", **labels) == pytest.approx(sum(seconds))
            assert _value(samples, f"{hist}_bucket", le="+Inf", **labels) == len(mine)
            assert _value(samples, f"{hist}_bucket", le="1.0", **labels) == sum(
                s <= 1 for s in seconds)
        for lease in ("held", "expired"):  # everything finished: no slot holds a lease
            assert _value(samples, "hybridtrain_hpo_leases", experiment=name, state=lease) == 0
    # The succeeded experiment: 3 complete; the broken one: 1 failure > 0 allowed, then
    # both of its slots (the failed one's, back to pending, and the unstarted one) cancelled.
    assert _value(samples, "hybridtrain_hpo_trials", experiment="branin", state="complete") == 3
    assert _value(samples, "hybridtrain_hpo_trials", experiment="broken", state="failed") == 1
    assert _value(samples, "hybridtrain_hpo_trials", experiment="broken",
                  state="cancelled") == 2
    # The controllers ran in this process, so their heartbeats were counted here.
    renewed = _value(samples, "hybridtrain_hpo_lease_renewals_total", experiment="branin")
    assert renewed == RENEWALS.snapshot()["branin"] > 0


def test_metrics_are_current_at_each_scrape(sqlite_url: str, make_spec: Any) -> None:
    store = ExperimentStore(sqlite_url)
    client = TestClient(create_app(store, TOKEN, launcher=None, dashboard=False))
    assert _value(_samples(client.get("/metrics", headers=AUTH).text),
                  "hybridtrain_hpo_experiments", state="running") == 0
    client.post("/v1/experiments", json=make_spec(max_trials=4), headers=AUTH)
    samples = _samples(client.get("/metrics", headers=AUTH).text)
    assert _value(samples, "hybridtrain_hpo_experiments", state="running") == 1
    assert _value(samples, "hybridtrain_hpo_trials", experiment="branin", state="waiting") == 4
    client.post("/v1/experiments/branin/stop", headers=AUTH)
    samples = _samples(client.get("/metrics", headers=AUTH).text)
    assert _value(samples, "hybridtrain_hpo_experiments", state="stopped") == 1


def test_storage_failure_reads_as_up_0(sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    client = TestClient(create_app(ExperimentStore(sqlite_url), TOKEN, launcher=None,
                                   dashboard=False))

    def broken(_self: Any) -> list[Any]:
        import sqlalchemy as sa

        raise sa.exc.OperationalError("SELECT", {}, Exception("database is locked"))

    monkeypatch.setattr(exporter.HPOCollector, "_families", broken)
    r = client.get("/metrics", headers=AUTH)
    assert r.status_code == 200
    assert _samples(r.text) == {("hybridtrain_hpo_up", ()): 0.0}


@pytest.mark.parametrize("public", [False, True])
def test_metrics_auth_and_no_body_is_ever_read(sqlite_url: str, public: bool) -> None:
    app = create_app(ExperimentStore(sqlite_url), TOKEN, launcher=None, dashboard=False,
                     metrics_public=public)
    client = TestClient(app)
    r = client.get("/metrics")
    if public:
        assert r.status_code == 200 and "hybridtrain_hpo_up 1.0" in r.text
    else:
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert client.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code \
            == 401
    assert client.get("/metrics", headers=AUTH).status_code == 200
    assert client.head("/metrics", headers=AUTH).status_code == 200
    # /v1 keeps needing the token either way.
    assert client.get("/v1/experiments").status_code == 401
    # A 400 MB upload to /metrics: refused from the headers, not one chunk read.
    huge = [(b"content-length", b"400000000")]
    status, _, read = _call(app, huge, chunks=6000, path="/metrics")
    assert (status, read) == ((405 if public else 401), 0)
    status, detail, read = _call(app, [*huge, (b"authorization", f"Bearer {TOKEN}".encode())],
                                 chunks=6000, path="/metrics")
    assert (status, read) == (405, 0) and "read-only" in detail


def test_openmetrics_when_asked(sqlite_url: str) -> None:
    client = TestClient(create_app(ExperimentStore(sqlite_url), TOKEN, launcher=None,
                                   dashboard=False))
    r = client.get("/metrics", headers=AUTH | {
        "Accept": "application/openmetrics-text; version=1.0.0"})
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.rstrip().endswith("# EOF")


def test_real_server_serves_metrics_behind_the_token(tmp_path: Path, sqlite_url: str) -> None:
    with serve_process(tmp_path, sqlite_url, token=TOKEN) as (_, base, out):
        assert f"metrics:   {base}/metrics  (bearer token needed)" in out.read_text()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(base + "/metrics", timeout=30)
        assert refused.value.code == 401
        request = urllib.request.Request(base + "/metrics", headers=AUTH)
        with urllib.request.urlopen(request, timeout=30) as response:
            samples = _samples(response.read().decode())
        assert _value(samples, "hybridtrain_hpo_up") == 1


def test_documented_podmonitor_scrapes_the_controller_with_its_token() -> None:
    """docs/hpo.md's PodMonitor validates against the vendored CRD schema and points at
    the hpo-controller's pods, its port and the token Secret of deploy/k8s/hpo."""
    import re

    import yaml

    from tests.deploy.test_manifests import MANIFESTS, _crd_validator, _one

    docs = (Path(__file__).resolve().parents[2] / "docs" / "hpo.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", docs, re.S) if "PodMonitor" in b]
    monitor = yaml.safe_load(block)
    errors = list(_crd_validator("monitoring.coreos.com/v1", "PodMonitor").iter_errors(monitor))
    assert not errors, [e.message for e in errors]
    controller = _one("Deployment", "hpo-controller")
    template = controller["spec"]["template"]
    assert monitor["metadata"]["namespace"] == controller["metadata"]["namespace"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= \
        template["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    ports = {p["name"] for c in template["spec"]["containers"] for p in c["ports"]}
    assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
    secret = endpoint["authorization"]["credentials"]
    (token,) = [d for _, d in MANIFESTS if d["kind"] == "Secret"
                and d["metadata"]["name"] == secret["name"]]
    assert secret["key"] in token["stringData"]
    env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
    assert env["HYBRIDTRAIN_HPO_TOKEN"]["valueFrom"]["secretKeyRef"] == secret
