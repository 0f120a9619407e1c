"""The two HTML documents of the jobs page: the list (``/jobs/``) and one job's page
(``/jobs/NAME``). Both are static: every value, job names included, comes from the page's
JSON routes and goes through ``esc`` (or ``textContent``) before it reaches the document, so
nothing a user controls is ever parsed as HTML. No external assets.
"""

from __future__ import annotations

import base64
import hashlib
import re

_STYLE = """<style>
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;width:100%;margin-bottom:1.5em}
td,th{border-bottom:1px solid #ddd;padding:.3em .6em;text-align:left;vertical-align:top}
.queued{color:#a60}.preempted{color:#a60;font-style:italic}.running{color:#06c}.succeeded{color:#080}
.failed{color:#c00}.cancelled,.pruned{color:#777}pre{background:#f6f6f6;padding:.6em;max-height:24em;overflow:auto}
#message{color:#c00}
tbody.group th{background:#f3f3f3;font-weight:normal}.curves{display:flex;flex-wrap:wrap;gap:1.5em}
.curves figure{margin:0}
</style>"""

#: Escapes text for HTML element content and quoted attribute values.
_ESCAPE = """const esc = s => String(s ?? "").replace(/[&<>"'`]/g,
  c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;", "`": "&#96;"}[c]));
function duration(s) {
  if (s === null || s === undefined) return "";
  s = Math.round(s);
  return s >= 3600 ? `${Math.floor(s / 3600)}h${Math.floor(s % 3600 / 60)}m` :
         s >= 60 ? `${Math.floor(s / 60)}m${s % 60}s` : `${s}s`;
}
function progressText(p) {
  if (!p || p.step === null) return "";
  let t = "step " + esc(p.step) + (p.total_steps !== null ? " of " + esc(p.total_steps) : "");
  if (p.eta_s !== null) t += ", ETA " + esc(duration(p.eta_s));
  if (p.tokens_per_s !== null) t += ", " + esc(Math.round(p.tokens_per_s)) + " tokens/s";
  if (p.eval_loss !== null) t += ", eval loss " + esc(p.eval_loss.toPrecision(4));
  return t;
}
"""

LIST_PAGE = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>hybridtrain jobs</title>
{_STYLE}</head><body>
<h1>hybridtrain jobs</h1><div id="summary"></div>
<form id="filters">state <select id="state" name="state"><option value="">all</option>
<option>queued</option><option>running</option><option>preempted</option><option>succeeded</option>
<option>failed</option><option>cancelled</option><option>pruned</option></select>
experiment <select id="experiment" name="experiment"><option value="">all</option></select></form>
<table id="jobs"><thead><tr><th>job</th><th>state</th><th>priority</th><th>progress</th><th>queue</th>
<th>devices</th><th>restarts</th><th>program</th><th>reason</th></tr></thead></table>
<script>
{_ESCAPE}
const params = new URLSearchParams(location.search);
const stateBox = document.getElementById("state"), experimentBox = document.getElementById("experiment");
stateBox.value = params.get("state") || "";
function queueText(j) {{
  if (j.queue_position === null) return "";
  return "#" + esc(j.queue_position) + ", waiting " + esc(duration(j.queue_wait_s));
}}
async function refresh() {{
  const query = new URLSearchParams();
  if (stateBox.value) query.set("state", stateBox.value);
  if (experimentBox.value) query.set("experiment", experimentBox.value);
  history.replaceState(null, "", "?" + query.toString());
  const r = await fetch("_data?" + query.toString());
  if (!r.ok) return;
  const d = await r.json(), s = d.summary;
  document.getElementById("summary").textContent = `${{s.devices.kind}} slots ${{s.devices.ids.length}}, ` +
    `busy ${{s.devices.busy.length}}; ` + Object.entries(s.jobs).map(([k, v]) => `${{k}} ${{v}}`).join(", ");
  const chosen = experimentBox.value || params.get("experiment") || "";
  experimentBox.innerHTML = '<option value="">all</option>' +
    d.experiments.map(e => `<option value="${{esc(e)}}">${{esc(e)}}</option>`).join("");
  experimentBox.value = chosen;
  const order = {{running: 0, queued: 1, preempted: 1}};
  d.jobs.sort((a, b) => (order[a.state] ?? 2) - (order[b.state] ?? 2) ||
    (a.queue_position ?? 0) - (b.queue_position ?? 0) || b.id - a.id);
  const table = document.getElementById("jobs");
  table.querySelectorAll("tbody").forEach(b => b.remove());
  table.insertAdjacentHTML("beforeend", groups(d.jobs).map(([experiment, jobs]) => groupHead(experiment, jobs) +
    jobs.map(row).join("") + "</tbody>").join(""));
}}
// Jobs under their experiment (an HPO experiment's trials together): the jobs of no experiment
// first, then each experiment by name; each group keeps the start order above.
function groups(jobs) {{
  const by = new Map();
  for (const j of jobs) {{
    const key = j.experiment ?? "";
    if (!by.has(key)) by.set(key, []);
    by.get(key).push(j);
  }}
  return [...by.entries()].sort(([a], [b]) => (a !== "") - (b !== "") || (a < b ? -1 : a > b ? 1 : 0));
}}
function groupHead(experiment, jobs) {{
  const counts = {{}};
  for (const j of jobs) counts[j.state] = (counts[j.state] ?? 0) + 1;
  const title = experiment === "" ? "no experiment" :
    `experiment <a href="?experiment=${{esc(encodeURIComponent(experiment))}}">${{esc(experiment)}}</a>`;
  return `<tbody class="group" data-experiment="${{esc(experiment)}}"><tr><th colspan="9">${{title}}: ` +
    `${{esc(jobs.length)}} job${{jobs.length === 1 ? "" : "s"}} (` +
    Object.entries(counts).map(([k, v]) => `${{esc(k)}} ${{esc(v)}}`).join(", ") + ")</th></tr>";
}}
function row(j) {{
  return `<tr>
    <td><a href="${{esc(encodeURIComponent(j.name))}}">${{esc(j.name)}}</a></td>
    <td class="${{esc(j.state)}}">${{esc(j.state)}}</td><td>${{esc(j.priority)}}</td>
    <td>${{progressText(j.progress)}}</td><td>${{queueText(j)}}</td><td>${{esc(JSON.stringify(j.devices))}}</td>
    <td>${{esc(j.restarts)}}/${{esc(j.max_restarts)}}</td>
    <td>${{esc(j.program)}}</td><td>${{esc(j.reason)}}</td></tr>`;
}}
stateBox.onchange = refresh; experimentBox.onchange = refresh;
refresh(); setInterval(refresh, 3000);
</script></body></html>
"""

JOB_PAGE = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>hybridtrain job</title>
{_STYLE}</head><body>
<p><a href="./">all jobs</a></p>
<h1 id="title"></h1>
<p><button id="cancel" type="button">cancel</button> <button id="resubmit" type="button">resubmit</button>
<span id="message"></span></p>
<div id="detail"></div>
<script>
{_ESCAPE}
const name = decodeURIComponent(location.pathname.split("/").pop());
document.getElementById("title").textContent = name;
document.title = "hybridtrain job " + name;
function curve(xs, ys, what, colour) {{
  if (!xs.length) return `<p>no ${{esc(what)}} values yet</p>`;
  const W = 480, H = 200;
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  const px = x => 40 + (W - 50) * (x1 > x0 ? (x - x0) / (x1 - x0) : 0.5);
  const py = y => 10 + (H - 30) * (y1 > y0 ? (y1 - y) / (y1 - y0) : 0.5);
  const pts = xs.map((x, i) => px(x).toFixed(1) + "," + py(ys[i]).toFixed(1)).join(" ");
  return `<svg width="${{W}}" height="${{H}}" role="img" aria-label="${{esc(what)}} curve">
    <polyline fill="none" stroke="${{colour}}" stroke-width="1.5" points="${{pts}}"/>
    <text x="2" y="14">${{esc(y1.toPrecision(4))}}</text><text x="2" y="${{H - 20}}">${{esc(y0.toPrecision(4))}}</text>
    <text x="40" y="${{H - 4}}">step ${{esc(x0)}}</text>
    <text x="${{W - 80}}" y="${{H - 4}}">step ${{esc(x1)}}</text></svg>`;
}}
function attemptText(h) {{
  const exit = h.exit_code === null || h.exit_code === undefined ? "" : ` (exit ${{esc(h.exit_code)}})`;
  return `<li>attempt ${{esc(h.attempt)}}: ${{esc(h.outcome)}}${{exit}} on ${{esc(JSON.stringify(h.devices))}}: ` +
    `${{esc(h.reason)}}</li>`;
}}
async function show() {{
  const r = await fetch("_data/" + encodeURIComponent(name));
  if (!r.ok) {{ document.getElementById("detail").textContent = "no such job"; return; }}
  const d = await r.json(), j = d.job, evals = d.progress.eval_curve;
  const queue = j.queue_position === null ? "" :
    `<p>queue position ${{esc(j.queue_position)}}, waiting ${{esc(duration(d.queue_wait_s))}}</p>`;
  document.getElementById("detail").innerHTML = `<p class="${{esc(j.state)}}">${{esc(j.state)}}</p>
    <p>${{esc(j.reason)}}</p><p>priority ${{esc(j.priority)}}; ${{progressText(d.progress)}}</p>${{queue}}
    <p>devices ${{esc(JSON.stringify(j.devices))}} of ${{esc(j.devices_requested)}} asked,
    restarts ${{esc(j.restarts)}}/${{esc(j.max_restarts)}}, attempt ${{esc(j.attempt)}}, backend ${{esc(j.backend)}},
    ${{j.preemptible ? "preemptible" : "not preemptible"}}; experiment ${{esc(j.experiment)}}</p>
    <p>program <code>${{esc(j.program)}}</code></p>
    <div class="curves"><figure id="loss-curve"><h3>loss</h3>${{curve(d.curve.steps, d.curve.loss, "loss", "#06c")}}
    </figure><figure id="eval-curve"><h3>eval loss</h3>${{curve(evals.steps, evals.eval_loss, "eval loss", "#c60")}}
    </figure></div><h3>attempts</h3><ul>${{d.attempts.map(attemptText).join("") ||
    "<li>none yet</li>"}}</ul><h3>log (last 64 KiB)</h3><pre>${{esc(d.log)}}</pre>`;
}}
async function act(action) {{
  if (!confirm(`${{action}} job ${{name}}?`)) return;
  const r = await fetch(encodeURIComponent(name) + "/" + action,
    {{method: "POST", headers: {{"X-Hybridtrain-Page": "1"}}}});
  const body = await r.json().catch(() => ({{}}));
  document.getElementById("message").textContent = r.ok ? `${{action}}: ${{body.state}}` :
    `${{action}} refused: ${{body.detail ?? r.status}}`;
  show();
}}
document.getElementById("cancel").onclick = () => act("cancel");
document.getElementById("resubmit").onclick = () => act("resubmit");
show(); setInterval(show, 3000);
</script></body></html>
"""


def security_policy(document: str) -> str:
    """The ``Content-Security-Policy`` of one of these documents: only its own inline script
    (by hash) runs, so a value that escaped ``esc`` still could not run script; fetches go to
    this origin only; nothing loads from elsewhere."""
    scripts = re.findall(r"<script>(.*?)</script>", document, re.DOTALL)
    hashes = " ".join("'sha256-" + base64.b64encode(hashlib.sha256(s.encode()).digest()).decode() + "'"
                      for s in scripts)
    return (f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; connect-src 'self'; "
            "img-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
