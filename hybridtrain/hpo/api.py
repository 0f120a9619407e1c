"""The REST API of the HPO service (FastAPI; OpenAPI schema at ``/openapi.json``).

=======  =================================  ===========================================
method   path                               what
=======  =================================  ===========================================
GET      /health                            liveness, no token needed
GET      /v1/experiments                    every experiment's status
POST     /v1/experiments                    create (or resume) from a spec; starts a worker
GET      /v1/experiments/{name}             status and spec
POST     /v1/experiments/{name}/stop        stop its trials (resumable)
GET      /v1/experiments/{name}/trials      trials with parameters and metrics
GET      /v1/experiments/{name}/best        best value, parameters, trial number
GET      /metrics                           Prometheus text (:mod:`hybridtrain.hpo.exporter`)
=======  =================================  ===========================================

Every ``/v1`` route needs ``Authorization: Bearer TOKEN``, checked from the headers
before any byte of the body is read (:mod:`hybridtrain.server.guard`); so does ``/metrics``
unless the app is made with ``metrics_public=True`` (``hpo serve --metrics-public``).
Errors are JSON ``{"detail": "one line"}`` (:mod:`hybridtrain.server.rest`): 401 without token, 404 unknown experiment,
405 anything but GET on ``/metrics``, 409 a spec that conflicts with the stored
experiment, 413 a body over the limit, 422 an invalid spec or request, 501 ``/metrics``
without ``prometheus_client``, 503 the storage cannot be reached, 507 the storage is full.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, HTTPException, Request
from fastapi.responses import Response

from hybridtrain import __version__
from hybridtrain.hpo.errors import ExperimentNotFoundError, HPOError
from hybridtrain.hpo.experiments import ExperimentStore
from hybridtrain.hpo.spec import ExperimentSpec, load_spec
from hybridtrain.server.auth import Admits
from hybridtrain.server.guard import DEFAULT_MAX_BODY, METRICS_PATH, ApiGuard
from hybridtrain.server.rest import answer_errors_in_one_line, require_token

Launcher = Callable[[ExperimentSpec, str], Any]


def launch_worker(spec: ExperimentSpec, storage_url: str) -> subprocess.Popen[bytes]:
    """Start ``python -m hybridtrain.hpo worker NAME`` in its own session.

    The worker is an ordinary controller: it outlives the server and can be stopped
    through the API. Its output goes to ``OUTPUT_DIR/NAME/worker.log``. A daemon thread
    waits for it, so a finished worker is reaped at once instead of staying a zombie
    for the server's lifetime.
    """
    log_dir = Path(spec.output_dir) / spec.name
    log_dir.mkdir(parents=True, exist_ok=True)
    with (log_dir / "worker.log").open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hybridtrain.hpo", "worker", spec.name,
             "--storage", storage_url],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    threading.Thread(target=proc.wait, name=f"reap-worker-{proc.pid}", daemon=True).start()
    return proc


def create_app(store: ExperimentStore, token: str, launcher: Launcher | None = launch_worker,
               dashboard: bool = True, max_body: int = DEFAULT_MAX_BODY,
               metrics_public: bool = False, admits: Admits | None = None) -> FastAPI:
    """The FastAPI application.

    Args:
        store: the experiments' storage.
        token: the bearer token every ``/v1`` request must carry.
        launcher: starts a controller for a created experiment (``None``: create only,
            e.g. when workers are started separately with ``hpo worker``).
        dashboard: mount optuna-dashboard at ``/`` (behind the same token).
        max_body: largest request body in bytes (413 above it).
        metrics_public: serve ``/metrics`` without the token (for a Prometheus that
            scrapes without credentials); read-only either way.
        admits: whether another token opens a path (the training service's users).

    Returns:
        The app, ready for uvicorn or FastAPI's ``TestClient``.
    """
    app = FastAPI(title="hybridtrain HPO", version=__version__,
                  description="Katib-style hyperparameter optimization on Optuna.")
    app.state.token = token
    app.add_middleware(ApiGuard, token=token, max_body=max_body,
                       metrics_public=metrics_public, admits=admits)

    answer_errors_in_one_line(app)
    auth = [Depends(require_token)]

    @app.get("/health")
    def health() -> dict[str, str]:
        """Liveness probe (no token needed)."""
        return {"status": "ok"}

    @app.get("/v1/experiments", dependencies=auth)
    def list_experiments() -> list[dict[str, Any]]:
        """Every experiment with its state and trial counts."""
        return store.list_experiments()

    @app.post("/v1/experiments", dependencies=auth, status_code=201)
    def create_experiment(spec: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
        """Validate a spec, store the experiment (or resume it) and start a worker."""
        parsed = load_spec(spec)
        record = store.create(parsed, exact=True)
        if launcher is not None and record.state == "running":
            launcher(parsed, store.url)
        return store.status(parsed.name)

    @app.get("/v1/experiments/{name}", dependencies=auth)
    def get_experiment(name: str) -> dict[str, Any]:
        """Status and stored spec of one experiment."""
        return store.status(name) | {"spec": store.records.get(name).spec}

    @app.post("/v1/experiments/{name}/stop", dependencies=auth)
    def stop_experiment(name: str) -> dict[str, Any]:
        """Stop the experiment's trials on every controller; resumable later."""
        return store.stop(name)

    @app.get("/v1/experiments/{name}/trials", dependencies=auth)
    def list_trials(name: str) -> list[dict[str, Any]]:
        """Trials with state, value, parameters, metrics and intermediate values."""
        return store.trials(name)

    @app.get("/v1/experiments/{name}/best", dependencies=auth)
    def best(name: str) -> dict[str, Any]:
        """The best completed trial (404 while none has completed)."""
        try:
            return store.best(name)
        except ExperimentNotFoundError:
            raise
        except HPOError as exc:
            raise HTTPException(404, str(exc)) from None

    registry: Any = None  # built on the first scrape
    metrics_auth = [] if metrics_public else auth

    @app.get(METRICS_PATH, response_class=Response, dependencies=metrics_auth)
    def metrics(request: Request) -> Response:
        """Prometheus text: experiments and trials by state, trial durations, leases.

        Read from the storage at each scrape; nothing is kept between scrapes. OpenMetrics
        when the scraper's ``Accept`` asks for it, as ``prometheus_client`` serves."""
        nonlocal registry
        try:
            from prometheus_client.exposition import choose_encoder

            from hybridtrain.hpo.exporter import metrics_registry
        except ImportError:
            raise HTTPException(501, "/metrics needs prometheus_client: pip install "
                                     "prometheus-client (or hybridtrain[monitor])") from None
        if registry is None:
            registry = metrics_registry(store)
        encode, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encode(registry), headers={"content-type": content_type})

    app.add_api_route(METRICS_PATH, metrics, methods=["HEAD"], response_class=Response,
                      dependencies=metrics_auth, include_in_schema=False)

    if dashboard:
        from hybridtrain.hpo.dashboard import dashboard_app

        app.mount("/", dashboard_app(store.optuna_storage, token))
    return app
