"""``hybridtrain serve``: the training service and the HPO service in one process.

One uvicorn server, one storage, one token: ``/v1/experiments`` (the HPO service's app,
:func:`hybridtrain.hpo.api.create_app`), ``/v1/jobs`` (:mod:`hybridtrain.service.api`), the
jobs page at ``/jobs``, the optuna-dashboard at ``/``, and ``/metrics`` with both services'
series. A scheduler thread ticks beside it. Stopping the server (Ctrl-C, SIGTERM) leaves
running jobs running: the next ``serve`` adopts them (see :mod:`hybridtrain.service.local`).
It sits with the commands, above both services, because it is the one place that hosts both.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import HTTPException, Request
from fastapi.responses import RedirectResponse, Response
from fastapi.routing import APIRoute

from hybridtrain.server.errors import ServerError
from hybridtrain.server.listen import bind, check_host, check_port, is_loopback
from hybridtrain.service.backend import DEFAULT_JOBS_DIR
from hybridtrain.service.devices import detect_slots
from hybridtrain.service.opening import make_backends, open_service

if TYPE_CHECKING:
    from fastapi import FastAPI

    from hybridtrain.service.api import JobService

#: Longest leader lease ``serve --lease`` takes (a leader that dies is replaced after it).
MAX_LEASE_S = 3600.0


def build_app(service: JobService, token: str, metrics_public: bool = False,
              dashboard: bool = True) -> FastAPI:
    """The combined app: HPO routes, job routes, jobs page, dashboard, ``/metrics``."""
    from hybridtrain.hpo.api import create_app, launch_worker
    from hybridtrain.hpo.experiments import ExperimentStore
    from hybridtrain.server.guard import METRICS_PATH
    from hybridtrain.service.api import job_router
    from hybridtrain.service.exporter import JobCollector
    from hybridtrain.service.page import jobs_page_app
    from hybridtrain.service.users import Authenticator

    experiments = ExperimentStore(service.store.url)
    auth = Authenticator(token, service.users)
    app = create_app(experiments, token, launcher=launch_worker, dashboard=False,
                     metrics_public=metrics_public, admits=auth.admits)
    app.title = "hybridtrain service"
    app.include_router(job_router(service, auth))
    registry: Any = None

    def metrics(request: Request) -> Response:
        nonlocal registry
        try:
            from prometheus_client import CollectorRegistry
            from prometheus_client.exposition import choose_encoder

            from hybridtrain.hpo.exporter import HPOCollector
        except ImportError:
            raise HTTPException(501, "/metrics needs prometheus_client: pip install "
                                     "prometheus-client") from None
        if registry is None:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(HPOCollector(experiments))
            registry.register(JobCollector(service.store, service.scheduler.slots))
        encode, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encode(registry), headers={"content-type": content_type})

    # Both services' series on one /metrics: this route goes before the HPO app's own
    # (Starlette serves the first matching route). The guard in front already checked
    # the token (unless --metrics-public) and refused other methods.
    app.router.routes.insert(0, APIRoute(METRICS_PATH, metrics, methods=["GET", "HEAD"],
                                         response_class=Response, include_in_schema=False))
    # The page's address is /jobs (what `serve` prints); its app is mounted at /jobs/, so
    # /jobs itself redirects there, query (the login token) kept. Without this route the
    # dashboard mounted at / would answer /jobs with its 404.
    app.add_api_route("/jobs", _to_jobs_page, methods=["GET"], include_in_schema=False)
    app.mount("/jobs", jobs_page_app(service, auth))
    if dashboard:
        from hybridtrain.hpo.dashboard import dashboard_app

        app.mount("/", dashboard_app(experiments.optuna_storage, token))
    return app


def _to_jobs_page(request: Request) -> Response:
    query = request.url.query
    return RedirectResponse("/jobs/" + (f"?{query}" if query else ""), status_code=307)


def check_serve_options(host: str, port: int, lease: float, jobs_dir: Path) -> None:
    """Refuse bad ``serve`` options in one line, before anything starts or is written.

    Raises:
        ServerError: a port TCP does not have, a host that is no address, a lease that is
            not a positive finite number of seconds, a jobs directory that is a file.
    """
    check_port(port)
    check_host(host)
    # A lease of nan is never "live" nor "expired", so no scheduler would ever lead.
    if not (math.isfinite(lease) and 0 < lease <= MAX_LEASE_S):
        raise ServerError(f"--lease {lease}: give seconds in (0, {MAX_LEASE_S:g}]")
    for path in (jobs_dir, *jobs_dir.parents):
        if path.exists() and not path.is_dir():
            raise ServerError(f"--jobs-dir {str(jobs_dir)[:200]!r}: {str(path)[:200]!r} is a file, "
                              "not a directory")


def serve(host: str = "127.0.0.1", port: int = 8080, storage: str | None = None,
          token_file: Path | None = None, metrics_public: bool = False,
          jobs_dir: Path = DEFAULT_JOBS_DIR, ray_address: str | None = None,
          kubernetes_namespace: str | None = None, image: str = "hybridtrain:latest",
          lease: float = 10.0, preemption: bool = True) -> int:
    """Serve until interrupted (port 0: a free port, printed); ``preemption=False``: a
    job of higher priority waits for devices instead of preempting running jobs.

    Raises:
        ServerError: bad options (:func:`check_serve_options`), token or storage, a port
            in use; ValueError: bad ``$HYBRIDTRAIN_SERVICE_DEVICES``.
    """
    import uvicorn

    from hybridtrain.server.auth import DEFAULT_TOKEN_FILE, TOKEN_ENV, resolve_token

    check_serve_options(host, port, lease, jobs_dir)
    token, created = resolve_token(token_file)
    slots = detect_slots()
    backends = make_backends(slots, ray_address, kubernetes_namespace, image)
    for backend in backends.values():
        backend.check()  # a cluster that is not there: refused now, not at the first job
    sock = bind(host, port)
    port = sock.getsockname()[1]
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    base = f"http://{shown}:{port}"
    # Job directories hold logs and environments: the owner's only.
    try:
        jobs_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        sock.close()
        raise ServerError(f"--jobs-dir {str(jobs_dir)[:200]!r}: {exc.strerror}") from None
    service = open_service(storage, jobs_dir, base, backends, slots, lease, preemption)
    app = build_app(service, token, metrics_public=metrics_public)
    if created:
        print(f"generated API token (saved; set ${TOKEN_ENV} to override): {token}", flush=True)
    from_env = bool(os.environ.get(TOKEN_ENV, "").strip())
    where = f"${TOKEN_ENV}" if from_env else (token_file or DEFAULT_TOKEN_FILE).expanduser()
    print(f"admin token: in {where}; users get their own with "
          "`hybridtrain serve users add NAME [--devices N]`", flush=True)
    if not is_loopback(host):
        print(f"warning: binding {host}: jobs run commands on this machine; anyone who has "
              "the token can start them", file=sys.stderr)
    print(f"REST API:  {base}/v1/jobs  {base}/v1/experiments  (schema: {base}/openapi.json)\n"
          f"jobs page: {base}/jobs?token=<token>\n"
          f"dashboard: {base}/dashboard?token=<token>\n"
          f"metrics:   {base}/metrics  "
          f"({'no token needed' if metrics_public else 'bearer token needed'})\n"
          f"devices:   {len(slots.ids)} {slots.kind} slots; jobs in {service.jobs_dir}",
          flush=True)
    stop = threading.Event()
    thread = threading.Thread(target=service.scheduler.run, args=(stop,), name="scheduler",
                              daemon=True)
    thread.start()
    try:
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        server.run(sockets=[sock])
    finally:
        stop.set()
        service.scheduler.wake.set()
        thread.join(30)
    return 0
