"""A real headless Chromium driven over the DevTools protocol, and the checks of the jobs page
it runs (issue #35): load the address ``serve`` prints, follow the link to a running job's
page, see its loss and eval-loss curves side by side, press cancel, accept the confirmation
and see the job's state change to ``cancelled``; open a job whose output is hostile HTML and
see that no script of it runs; see jobs grouped under their experiment and the filter keep one
group; report any Content-Security-Policy violation or script error.

Used by ``tests/service/test_page_browser.py`` and ``scripts/browser_check_page.py``. Needs
``chromium`` (Debian: ``apt-get install chromium``; ``.ci/chromium.sh``) and
``websocket-client``. No pytest here, so the script can use it too.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.service.serving import TOKEN, serving

HOSTILE = "<img src=x onerror=alert(1)><script>alert(2)</script>"


def chromium() -> str | None:
    """The path of a Chromium (or Chrome) binary on ``PATH``; ``None`` when there is none."""
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


class DevTools:
    """A minimal Chrome DevTools Protocol client over one page session."""

    def __init__(self, browser_ws: str) -> None:
        import websocket

        self.ws = websocket.create_connection(browser_ws, timeout=30, suppress_origin=True)
        self.ids = itertools.count(1)
        self.events: list[dict[str, Any]] = []
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable", session=True)

    def send(self, method: str, params: dict[str, Any] | None = None, session: bool = False) -> Any:
        """Call ``method`` and return its result (events that arrive meanwhile are kept)."""
        call_id = next(self.ids)
        message: dict[str, Any] = {"id": call_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = self.session
        self.ws.send(json.dumps(message))
        while True:
            reply = json.loads(self.ws.recv())
            if reply.get("id") == call_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self._note(reply)

    def _note(self, event: dict[str, Any]) -> None:
        """Keep an event; accept a dialog at once (as a user confirming would), or the call
        that opened it (a click calling ``confirm``) would never return."""
        self.events.append(event)
        if event.get("method") == "Page.javascriptDialogOpening":
            self.ws.send(json.dumps({"id": next(self.ids), "sessionId": self.session,
                                     "method": "Page.handleJavaScriptDialog", "params": {"accept": True}}))

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True}, session=True)
        return result.get("result", {}).get("value")

    def pump(self, seconds: float) -> None:
        """Collect events for ``seconds`` (accepting every dialog)."""
        deadline = time.monotonic() + seconds
        self.ws.settimeout(0.2)
        try:
            while time.monotonic() < deadline:
                try:
                    event = json.loads(self.ws.recv())
                except Exception:  # noqa: BLE001 (websocket timeout: nothing arrived)
                    continue
                self._note(event)
        finally:
            self.ws.settimeout(30)

    def wait(self, expression: str, seconds: float) -> Any:
        """Poll ``expression`` until it is truthy; its value, or ``None`` after ``seconds``."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            self.pump(0.3)
        return None

    def dialogs(self) -> list[str]:
        """Messages of every dialog the page opened (confirm, alert)."""
        return [e["params"]["message"] for e in self.events if e.get("method") == "Page.javascriptDialogOpening"]

    def problems(self) -> list[str]:
        """Console errors, CSP violations and uncaught exceptions the page reported."""
        out = []
        for event in self.events:
            if event.get("method") == "Log.entryAdded" and event["params"]["entry"]["level"] == "error":
                out.append(event["params"]["entry"]["text"])
            if event.get("method") == "Runtime.exceptionThrown":
                out.append(event["params"]["exceptionDetails"].get("text", "exception"))
        return out


def rest(base: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """One REST call with the bearer token."""
    request = urllib.request.Request(f"{base}{path}", method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def until(predicate: Callable[[], bool], seconds: float) -> bool:
    """Whether ``predicate`` became true within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.3)
    return False


def start_browser(workdir: Path) -> tuple[subprocess.Popen[str], str]:
    """Headless Chromium with remote debugging; the process and its browser websocket URL."""
    binary = chromium()
    if binary is None:
        raise RuntimeError("no chromium on PATH (Debian: apt-get install chromium)")
    # A laptop-sized window: the job page's two curves fit side by side.
    flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900",
             "--no-first-run", "--remote-debugging-port=0", f"--user-data-dir={workdir / 'profile'}"]
    proc = subprocess.Popen([binary, *flags, "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        found = re.search(r"DevTools listening on (ws://\S+)", line)
        if found:  # keep draining its output, or a full pipe would stall it
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, found.group(1)
    raise RuntimeError(f"chromium exited ({proc.wait()})")


@contextlib.contextmanager
def browsing(workdir: Path) -> Iterator[DevTools]:
    """A headless Chromium's page session (its profile under ``workdir``), closed on exit."""
    browser, ws_url = start_browser(workdir)
    try:
        tools = DevTools(ws_url)
        yield tools
        tools.ws.close()
    finally:
        browser.terminate()
        browser.wait(30)


def check_page(workdir: Path) -> list[tuple[str, bool]]:
    """Start ``serve`` and a browser under ``workdir``, run :func:`run_checks`, stop both (the
    sleeping job cancelled first: a stopped ``serve`` leaves its jobs running)."""
    with serving(workdir) as printed:
        base = printed["base"]
        try:
            with browsing(workdir) as tools:
                return run_checks(base, tools, workdir)
        finally:
            with contextlib.suppress(OSError):  # best effort: the job may not exist
                rest(base, "POST", "/v1/jobs/sleeper/cancel")


def run_checks(base: str, tools: DevTools, workdir: Path) -> list[tuple[str, bool]]:
    """The checks, each as (what, passed), then whether the page reported no problem."""
    results = check_job_page(base, tools) + check_hostile_output(base, tools) + check_groups(base, tools, workdir)
    problems = tools.problems()
    results.append((f"no CSP violation or script error ({problems[:3]})", not problems))
    return results


#: A job that writes eight steps' losses and two evaluations to its metrics file, then sleeps.
SLEEPER = ("import json, os, time\n"
           "with open(os.path.join(os.environ['HYBRIDTRAIN_JOB_DIR'], 'metrics.jsonl'), 'w') as f:\n"
           "    for s in range(1, 9): f.write(json.dumps({'step': s, 'loss': 3 - s / 10}) + '\\n')\n"
           "    for s in (4, 8): f.write(json.dumps({'step': s, 'eval_loss': 3.5 - s / 10}) + '\\n')\n"
           "time.sleep(600)")


def _points(figure: str) -> str:
    """JavaScript: the number of points of the curve in ``figure`` (0 without one)."""
    return (f"(document.querySelector('#{figure} polyline') ? "
            f"document.querySelector('#{figure} polyline').getAttribute('points').split(' ').length : 0)")


def check_job_page(base: str, tools: DevTools) -> list[tuple[str, bool]]:
    """The printed address lists a running job; its page shows it running, its loss and eval-loss
    curves side by side; cancel asks, then the page and the service show it cancelled."""
    results: list[tuple[str, bool]] = []
    rest(base, "POST", "/v1/jobs", {"name": "sleeper", "command": [sys.executable, "-c", SLEEPER], "kill_grace": 5})
    results.append(("the job runs", until(lambda: rest(base, "GET", "/v1/jobs/sleeper")["state"] == "running", 60)))
    tools.send("Page.navigate", {"url": f"{base}/jobs?token={TOKEN}"}, session=True)
    link = tools.wait("document.querySelector('#jobs td a') && document.querySelector('#jobs td a').textContent", 20)
    results.append(("the list at the printed address shows the job, linked", link == "sleeper"))
    tools.evaluate("document.querySelector('#jobs td a').click()")
    state = tools.wait("location.pathname.endsWith('/jobs/sleeper') && "
                       "document.querySelector('#detail p') && document.querySelector('#detail p').textContent", 20)
    results.append(("the job's own page at /jobs/sleeper shows it running", state == "running"))
    attempt = tools.evaluate("document.querySelector('#detail ul').textContent")
    results.append(("the running attempt is listed", bool(attempt) and "attempt 1: running" in attempt))
    curves = tools.wait(f"{_points('eval-curve')} === 2 && [{_points('loss-curve')}, {_points('eval-curve')}]", 20)
    results.append((f"the loss curve (8 steps) and the eval-loss curve (2 evaluations) are drawn ({curves})",
                    curves == [8, 2]))
    beside = tools.evaluate("(() => { const a = document.getElementById('loss-curve').getBoundingClientRect(), "
                            "b = document.getElementById('eval-curve').getBoundingClientRect(); "
                            "return b.left >= a.right && b.top === a.top; })()")
    results.append(("the eval-loss curve is beside the loss curve", beside is True))
    tools.evaluate("document.getElementById('cancel').click()")
    tools.pump(1)
    results.append(("cancel asks for confirmation", any("cancel job sleeper" in m for m in tools.dialogs())))
    shown = tools.wait("document.querySelector('#detail p').textContent === 'cancelled' && "
                       "document.getElementById('message').textContent", 30)
    results.append(("after cancel the page shows the job cancelled", bool(shown)))
    results.append(("the service has it cancelled", rest(base, "GET", "/v1/jobs/sleeper")["state"] == "cancelled"))
    return results


def check_hostile_output(base: str, tools: DevTools) -> list[tuple[str, bool]]:
    """A job whose output is HTML with script: shown as text, nothing of it runs or is made."""
    results: list[tuple[str, bool]] = []
    rest(base, "POST", "/v1/jobs", {"name": "hostile", "command": ["echo", HOSTILE], "devices": 0})
    until(lambda: rest(base, "GET", "/v1/jobs/hostile")["state"] == "succeeded", 60)
    before = len(tools.dialogs())
    tools.send("Page.navigate", {"url": f"{base}/jobs/hostile"}, session=True)
    log = tools.wait("document.querySelector('pre') && document.querySelector('pre').textContent", 20)
    tools.pump(2)
    results.append(("hostile output is shown as text", bool(log) and HOSTILE in log))
    results.append(("no script of it ran (no alert)", len(tools.dialogs()) == before))
    images = tools.evaluate("document.querySelectorAll('#detail img').length")
    results.append(("no element of it was made", images == 0))
    return results


def check_groups(base: str, tools: DevTools, workdir: Path) -> list[tuple[str, bool]]:
    """The list groups jobs under their experiment (two trials of ``exp-a`` stored as an HPO
    experiment's are), and the experiment filter keeps one group."""
    from hybridtrain.service.spec import JobSpec
    from hybridtrain.service.store import JobStore

    store = JobStore(f"sqlite:///{workdir / 's.db'}")
    for number in (0, 1):
        name = f"exp-a-trial-{number}"
        store.submit(JobSpec(name=name, command=("true",), devices=0, priority=-9), str(workdir / "jobs" / name),
                     kind="trial", experiment="exp-a", trial_number=number)
    tools.send("Page.navigate", {"url": f"{base}/jobs/"}, session=True)
    grouped = ("Array.from(document.querySelectorAll('#jobs tbody.group')).map(b => [b.dataset.experiment, "
               "Array.from(b.querySelectorAll('td a')).map(a => a.textContent).sort().join(' ')])")
    groups = tools.wait(f"document.querySelectorAll('#jobs tbody.group').length === 2 && {grouped}", 20)
    results = [(f"jobs are grouped under their experiment ({groups})",
                groups == [["", "hostile sleeper"], ["exp-a", "exp-a-trial-0 exp-a-trial-1"]])]
    head = tools.evaluate("document.querySelector('#jobs tbody.group[data-experiment=\"exp-a\"] th').textContent")
    results.append((f"the group says its experiment and count ({head!r})",
                    bool(head) and head.startswith("experiment exp-a: 2 jobs")))
    tools.evaluate("const box = document.getElementById('experiment'); box.value = 'exp-a'; "
                   "box.dispatchEvent(new Event('change'))")
    kept = tools.wait(f"document.querySelectorAll('#jobs tbody.group').length === 1 && "
                      f"location.search.includes('experiment=exp-a') && {grouped}", 20)
    results.append((f"the experiment filter keeps its group only, in the address ({kept})",
                    kept == [["exp-a", "exp-a-trial-0 exp-a-trial-1"]]))
    return results
