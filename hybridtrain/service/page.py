"""The jobs web page: ``/jobs/`` lists the jobs (filters by state and experiment, links to
each job), ``/jobs/NAME`` is one job's page (progress, attempts, loss curve, log, cancel and
resubmit buttons). Served behind the service's token or a user's (open it once with
``/jobs?token=…``, which sets the same HTTP-only cookie as the HPO dashboard); a user sees and
moves only their own jobs.

The pages read their data from routes inside the same token-guarded app (``/jobs/_data``,
``/jobs/_data/NAME``) and cancel or resubmit through ``POST /jobs/NAME/cancel|resubmit``, which
call what ``POST /v1/jobs/NAME/cancel|resubmit`` call, so the browser never holds the bearer
token in script. Those POSTs need the header ``X-Hybridtrain-Page`` (a cross-site form cannot
send it; the cookie is ``SameSite=Strict`` too).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import FastAPI, Header, HTTPException, Query, Request
from fastapi.responses import HTMLResponse

from hybridtrain.server.auth import ASGIApp, TokenGuard, bearer
from hybridtrain.service.errors import JobConflictError, JobNotFoundError, JobSpecError
from hybridtrain.service.page_html import JOB_PAGE, LIST_PAGE, security_policy
from hybridtrain.service.page_progress import attempts, progress, queue_wait_s

if TYPE_CHECKING:
    from hybridtrain.service.api import JobService
    from hybridtrain.service.store import JobRecord
    from hybridtrain.service.users import Authenticator, User

#: Bytes of a job's log the page shows.
PAGE_LOG = 64 * 1024
#: Header the page's POSTs carry (a plain cross-site form cannot set it).
PAGE_HEADER = "x-hybridtrain-page"


def jobs_page_app(service: JobService, auth: Authenticator) -> ASGIApp:
    """The pages, their data and action routes as a token-guarded ASGI app (mount at
    ``/jobs``)."""
    def html(document: str) -> HTMLResponse:
        return HTMLResponse(document, headers={"content-security-policy": security_policy(document),
                                               "x-content-type-options": "nosniff"})

    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    def caller(request: Request) -> User:
        user = auth.user(bearer(request.scope["headers"]))
        if user is None:  # the guard let no such request through; a revoked token, meanwhile
            raise HTTPException(401, "missing or invalid bearer token")
        return user

    def job_or_404(name: str, user: User) -> JobRecord:
        try:
            return service.job(name, user)
        except JobNotFoundError as exc:
            raise HTTPException(404, str(exc)) from None

    @app.get("/", response_class=HTMLResponse)
    def list_page() -> HTMLResponse:
        return html(LIST_PAGE)

    @app.get("/_data")
    def data(request: Request, state: Annotated[str | None, Query()] = None,
             experiment: Annotated[str | None, Query()] = None) -> dict[str, Any]:
        user = caller(request)
        positions = service.queue_positions()
        every = service.jobs(user)
        experiments = sorted({j.experiment for j in every if j.experiment})
        shown = [j for j in every if (not state or j.state in state.split(","))
                 and (not experiment or j.experiment == experiment)]
        jobs = [service.brief(j, positions) | {
            "progress": progress(j) if j.state == "running" else None,
            "queue_wait_s": queue_wait_s(j)} for j in shown]
        return {"summary": service.summary(user), "experiments": experiments, "jobs": jobs}

    @app.get("/_data/{name}")
    def detail(request: Request, name: str) -> dict[str, Any]:
        user = caller(request)
        job = job_or_404(name, user)
        size = _size(job.job_dir, job.spec.stdout_file)
        log = service.logs(name, max(0, size - PAGE_LOG), user)["text"]
        shown = job.as_dict() | {"queue_position": service.queue_positions().get(job.name)}
        return {"job": shown, "curve": service.curve(name, user), "log": log, "progress": progress(job),
                "queue_wait_s": queue_wait_s(job), "attempts": attempts(job)}

    @app.get("/{name}", response_class=HTMLResponse)
    def job_page(request: Request, name: str) -> HTMLResponse:
        job_or_404(name, caller(request))
        return html(JOB_PAGE)

    def act(request: Request, name: str, page_header: str | None, action: str) -> dict[str, Any]:
        if not page_header:
            raise HTTPException(403, f"the page's {action} needs the {PAGE_HEADER} header")
        user = caller(request)
        try:
            record = service.cancel(name, user) if action == "cancel" else service.resubmit(name, user=user)
        except JobNotFoundError as exc:
            raise HTTPException(404, str(exc)) from None
        except JobConflictError as exc:
            raise HTTPException(409, str(exc)) from None
        except JobSpecError as exc:
            raise HTTPException(422, str(exc)) from None
        return record.as_dict()

    @app.post("/{name}/cancel")
    def cancel(request: Request, name: str,
               page_header: Annotated[str | None, Header(alias=PAGE_HEADER)] = None) -> dict[str, Any]:
        return act(request, name, page_header, "cancel")

    @app.post("/{name}/resubmit")
    def resubmit(request: Request, name: str,
                 page_header: Annotated[str | None, Header(alias=PAGE_HEADER)] = None) -> dict[str, Any]:
        return act(request, name, page_header, "resubmit")

    return TokenGuard(app, auth.admin_token, auth.admits)


def _size(directory: str, name: str) -> int:
    try:
        return os.path.getsize(os.path.join(directory, name))
    except OSError:
        return 0
