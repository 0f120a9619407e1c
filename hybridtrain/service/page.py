"""The jobs web page: queue, running and finished jobs; per job its loss curve, devices,
restarts and log. Served at ``/jobs`` behind the service's token (open it once with
``/jobs?token=…``, which sets the same HTTP-only cookie as the HPO dashboard).

The page reads its data from routes inside the same token-guarded app (``/jobs/data``),
so the browser never holds the bearer token in script.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybridtrain.hpo.auth import ASGIApp, TokenGuard
from hybridtrain.service.errors import JobNotFoundError

if TYPE_CHECKING:
    from hybridtrain.service.api import JobService

_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>hybridtrain jobs</title>
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;width:100%;margin-bottom:1.5em}
td,th{border-bottom:1px solid #ddd;padding:.3em .6em;text-align:left;vertical-align:top}
tr.sel{background:#eef}tr{cursor:pointer}
.queued{color:#a60}.preempted{color:#a60;font-style:italic}.running{color:#06c}.succeeded{color:#080}.failed{color:#c00}
.cancelled,.pruned{color:#777}pre{background:#f6f6f6;padding:.6em;max-height:24em;overflow:auto}
</style></head><body>
<h1>hybridtrain jobs</h1><div id="summary"></div>
<table><thead><tr><th>job</th><th>state</th><th>devices</th><th>restarts</th>
<th>backend</th><th>program</th><th>reason</th></tr></thead><tbody id="jobs"></tbody></table>
<div id="detail"></div>
<script>
let selected = null;
const esc = s => String(s ?? "").replace(/[&<>"]/g, c => ({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;"}[c]));
function curve(c) {
  if (!c.steps.length) return "<p>no loss values yet</p>";
  const W = 600, H = 200, xs = c.steps, ys = c.loss;
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  const px = x => 40 + (W - 50) * (x1 > x0 ? (x - x0) / (x1 - x0) : 0.5);
  const py = y => 10 + (H - 30) * (y1 > y0 ? (y1 - y) / (y1 - y0) : 0.5);
  const pts = xs.map((x, i) => px(x).toFixed(1) + "," + py(ys[i]).toFixed(1)).join(" ");
  return `<svg width="${W}" height="${H}" role="img" aria-label="loss curve">
    <polyline fill="none" stroke="#06c" stroke-width="1.5" points="${pts}"/>
    <text x="2" y="14">${y1.toPrecision(4)}</text><text x="2" y="${H - 20}">${y0.toPrecision(4)}</text>
    <text x="40" y="${H - 4}">step ${x0}</text><text x="${W - 80}" y="${H - 4}">step ${x1}</text></svg>`;
}
async function show(name) {
  selected = name;
  const r = await fetch("data/" + encodeURIComponent(name));
  if (!r.ok) return;
  const d = await r.json(), j = d.job;
  const hist = j.history.map(h => `<li>attempt ${h.attempt}: ${esc(h.outcome)} (exit ${esc(h.exit_code)}) on ${esc(JSON.stringify(h.devices))}: ${esc(h.reason)}</li>`).join("");
  document.getElementById("detail").innerHTML = `<h2>${esc(j.name)} <span class="${j.state}">${j.state}</span></h2>
    <p>${esc(j.reason)}</p><p>devices ${esc(JSON.stringify(j.devices))} of ${j.devices_requested} asked,
    restarts ${j.restarts}/${j.max_restarts}, attempt ${j.attempt}, backend ${esc(j.backend)},
    ${j.preemptible ? "preemptible" : "not preemptible"}</p>
    <h3>loss</h3>${curve(d.curve)}<h3>attempts</h3><ul>${hist || "<li>none yet</li>"}</ul>
    <h3>log (last 64 KiB)</h3><pre>${esc(d.log)}</pre>`;
}
async function refresh() {
  const r = await fetch("data");
  if (!r.ok) return;
  const d = await r.json();
  const s = d.summary;
  document.getElementById("summary").textContent = `${s.devices.kind} slots ${s.devices.ids.length}, busy ${s.devices.busy.length}; ` +
    Object.entries(s.jobs).map(([k, v]) => `${k} ${v}`).join(", ");
  const order = {running: 0, queued: 1, preempted: 1};
  d.jobs.sort((a, b) => (order[a.state] ?? 2) - (order[b.state] ?? 2) || b.id - a.id);
  document.getElementById("jobs").innerHTML = d.jobs.map(j => `<tr data-name="${esc(j.name)}" class="${j.name === selected ? "sel" : ""}">
    <td>${esc(j.name)}</td><td class="${j.state}">${j.state}</td><td>${esc(JSON.stringify(j.devices))}</td>
    <td>${j.restarts}/${j.max_restarts}</td><td>${esc(j.backend)}</td><td>${esc(j.program)}</td><td>${esc(j.reason)}</td></tr>`).join("");
  for (const tr of document.querySelectorAll("#jobs tr")) tr.onclick = () => show(tr.dataset.name);
  if (selected) show(selected);
}
refresh(); setInterval(refresh, 3000);
</script></body></html>
"""

#: Bytes of a job's log the page shows.
PAGE_LOG = 64 * 1024


def jobs_page_app(service: JobService, token: str) -> ASGIApp:
    """The page and its data routes as a token-guarded ASGI app (mount at ``/jobs``)."""
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import HTMLResponse

    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    @app.get("/", response_class=HTMLResponse)
    def page() -> str:
        return _PAGE

    @app.get("/data")
    def data() -> dict[str, Any]:
        positions = service.queue_positions()
        jobs = [service.brief(j, positions) for j in service.store.jobs()]
        return {"summary": service.summary(), "jobs": jobs}

    @app.get("/data/{name}")
    def detail(name: str) -> dict[str, Any]:
        try:
            job = service.store.get(name)
        except JobNotFoundError as exc:
            raise HTTPException(404, str(exc)) from None
        size = _size(job.job_dir, job.spec.stdout_file)
        log = service.logs(name, max(0, size - PAGE_LOG))["text"]
        return {"job": job.as_dict(), "curve": service.curve(name), "log": log}

    return TokenGuard(app, token)


def _size(directory: str, name: str) -> int:
    import os

    try:
        return os.path.getsize(os.path.join(directory, name))
    except OSError:
        return 0
