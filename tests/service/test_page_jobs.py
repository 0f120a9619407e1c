"""The jobs page on a real ``hybridtrain serve`` (issue #35): a running training job's step N
of total, ETA, eval loss, eval-loss curve and running attempt; a queued job's position and wait; per-job pages
at ``/jobs/NAME`` linked from the list; filters; cancel and resubmit through the page; and
user-controlled text (names, programs, logs) that stays inert."""

from __future__ import annotations

import contextlib
import http.cookiejar
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from hybridtrain.service.page_html import JOB_PAGE, LIST_PAGE
from tests.service.conftest import AUTH, TOKEN, tiny_config, wait_for

pytestmark = pytest.mark.timeout(240)
HOSTILE = "<script>alert(1)</script><img src=x onerror=alert(2)>\"'`"


class Browser:
    """A cookie-keeping HTTP client logged in to the page as a browser is (``?token=``)."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.opener = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
        with self.opener.open(f"{base}/jobs?token={TOKEN}", timeout=30) as response:
            assert response.status == 200

    def get(self, path: str) -> tuple[int, dict[str, str], str]:
        try:
            with self.opener.open(self.base + path, timeout=30) as response:
                return response.status, dict(response.headers), response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read().decode()

    def json(self, path: str) -> Any:
        status, _, body = self.get(path)
        assert status == 200, (path, status, body)
        return json.loads(body)

    def post(self, path: str, page_header: bool = True) -> tuple[int, Any]:
        headers = {"X-Hybridtrain-Page": "1"} if page_header else {}
        request = urllib.request.Request(self.base + path, method="POST", headers=headers, data=b"")
        try:
            with self.opener.open(request, timeout=30) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")


def submit(base: str, spec: dict[str, Any]) -> tuple[int, Any]:
    """``POST /v1/jobs`` with the bearer token, as the CLI does."""
    request = urllib.request.Request(f"{base}/v1/jobs", method="POST", data=json.dumps(spec).encode(),
                                     headers=AUTH | {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def cancel_all(base: str) -> None:
    """Cancel every job still queued or running (a stopped ``serve`` leaves jobs running)."""
    request = urllib.request.Request(f"{base}/v1/jobs?state=queued,running,preempted", headers=AUTH)
    with urllib.request.urlopen(request, timeout=30) as response:
        names = [job["name"] for job in json.loads(response.read())]
    for name in names:
        with contextlib.suppress(urllib.error.HTTPError):
            urllib.request.urlopen(urllib.request.Request(
                f"{base}/v1/jobs/{name}/cancel", method="POST", data=b"", headers=AUTH), timeout=30)


def test_progress_queue_job_pages_filters_and_buttons(served: dict[str, str], tmp_path: Path) -> None:
    try:
        check_progress_queue_job_pages_filters_and_buttons(served["base"], tmp_path)
    finally:
        cancel_all(served["base"])


def check_progress_queue_job_pages_filters_and_buttons(base: str, tmp_path: Path) -> None:
    """Items 1-3 of issue #35 on one running training job and one queued job."""
    browser = Browser(base)
    config = tiny_config(tmp_path / "tiny.yaml", steps=100000, checkpoint_every=100000)
    status, _ = submit(base, {"name": "trainer", "config": str(config), "kill_grace": 60,
                              "overrides": ["train.eval_every=2", "train.eval_batches=1"]})
    assert status == 201
    # 1. the running attempt, step N of total, ETA and eval loss
    wait_for(lambda: (browser.json("/jobs/_data/trainer")["progress"]["eval_loss"] is not None), 150,
             "the trainer to report an eval loss")
    detail = browser.json("/jobs/_data/trainer")
    progress = detail["progress"]
    assert progress["step"] >= 2 and progress["total_steps"] == 100000, progress
    assert progress["eta_s"] > 0 and progress["tokens_per_s"] > 0, progress
    assert detail["attempts"][-1]["outcome"] == "running" and detail["attempts"][-1]["attempt"] == 1
    # the eval-loss curve: every evaluation of the metrics file so far, in order
    records = [json.loads(line) for line in (tmp_path / "jobs" / "trainer" / "run" / "metrics.jsonl").read_bytes()
               .splitlines() if line.strip()]
    evaluations = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    curve = progress["eval_curve"]
    assert curve["steps"] and list(zip(curve["steps"], curve["eval_loss"], strict=True)) == \
        evaluations[:len(curve["steps"])], (curve, evaluations)
    assert (progress["eval_step"], progress["eval_loss"]) == (curve["steps"][-1], curve["eval_loss"][-1])
    assert detail["job"]["priority"] == 0
    listed = {j["name"]: j for j in browser.json("/jobs/_data")["jobs"]}
    assert listed["trainer"]["progress"]["total_steps"] == 100000
    # queue position and wait of a job that waits for the one slot (lower priority: no preemption)
    status, _ = submit(base, {"name": "waiter", "command": [sys.executable, "-c", "import time; time.sleep(600)"],
                              "priority": -5, "kill_grace": 5})
    assert status == 201
    waiting = {j["name"]: j for j in browser.json("/jobs/_data")["jobs"]}["waiter"]
    assert waiting["state"] == "queued" and waiting["queue_position"] == 1, waiting
    assert waiting["queue_wait_s"] >= 0 and waiting["priority"] == -5
    # 3. filters by state and experiment
    assert [j["name"] for j in browser.json("/jobs/_data?state=queued")["jobs"]] == ["waiter"]
    assert [j["name"] for j in browser.json("/jobs/_data?state=running")["jobs"]] == ["trainer"]
    assert browser.json("/jobs/_data?experiment=no-such")["jobs"] == []
    assert 'id="state"' in LIST_PAGE and 'id="experiment"' in LIST_PAGE
    # 2. a page per job at its own address, linked from the list, behind the token
    status, headers, body = browser.get("/jobs/trainer")
    assert status == 200 and body == JOB_PAGE and 'id="cancel"' in body and 'id="resubmit"' in body
    assert "script-src 'sha256-" in headers["content-security-policy"]
    assert browser.get("/jobs/no-such-job")[0] == 404
    # a job may be called "data": the data routes begin with "_", which no job name can
    assert submit(base, {"name": "data", "command": [sys.executable, "-c", "pass"], "priority": -9})[0] == 201
    status, _, body = browser.get("/jobs/data")
    assert status == 200 and body == JOB_PAGE
    assert browser.json("/jobs/_data/data")["job"]["name"] == "data"
    assert browser.post("/jobs/data/cancel")[0] == 200  # still queued: cancelled at once
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{base}/jobs/trainer", timeout=30)
    assert refused.value.code == 401
    assert 'href="${esc(encodeURIComponent(j.name))}"' in LIST_PAGE
    # 3. cancel and resubmit through the page: the header and the cookie are needed
    assert browser.post("/jobs/trainer/cancel", page_header=False)[0] == 403
    anonymous = urllib.request.Request(f"{base}/jobs/trainer/cancel", method="POST", data=b"",
                                       headers={"X-Hybridtrain-Page": "1"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(anonymous, timeout=30)
    assert refused.value.code == 401
    status, cancelled = browser.post("/jobs/trainer/cancel")
    assert status == 200 and cancelled["cancel_requested"], cancelled
    wait_for(lambda: browser.json("/jobs/_data/trainer")["job"]["state"] == "cancelled", 90,
             "the trainer to stop")
    wait_for(lambda: browser.json("/jobs/_data/waiter")["job"]["state"] == "running", 30,
             "the waiter to take the freed slot")
    status, resubmitted = browser.post("/jobs/trainer/resubmit")
    assert status == 200 and resubmitted["state"] == "queued", resubmitted
    assert browser.post("/jobs/no-such-job/resubmit")[0] == 404
    for name in ("trainer", "waiter"):  # a stopped serve leaves jobs running: stop them first
        browser.post(f"/jobs/{name}/cancel")
    wait_for(lambda: all(j["state"] == "cancelled" for j in browser.json("/jobs/_data")["jobs"]), 60,
             "both jobs to stop")


def test_hostile_text_is_inert(served: dict[str, str]) -> None:
    base = served["base"]
    browser = Browser(base)
    assert submit(base, {"name": HOSTILE, "command": ["true"]})[0] == 422  # names are plain words
    status, _ = submit(base, {"name": "hostile", "command": ["echo", HOSTILE], "devices": 0})
    assert status == 201
    wait_for(lambda: browser.json("/jobs/_data/hostile")["job"]["state"] == "succeeded", 60,
             "the hostile job to finish")
    for path in ("/jobs/", "/jobs/hostile"):
        status, headers, body = browser.get(path)
        # The documents are static: no user text is rendered into them by the server...
        assert status == 200 and body in (LIST_PAGE, JOB_PAGE) and "alert" not in body
        # ...and only the page's own script may run, even if a value slipped past esc().
        policy = headers["content-security-policy"]
        assert "script-src 'sha256-" in policy and "unsafe-inline" not in policy.split("script-src")[1].split(";")[0]
        assert headers["x-content-type-options"] == "nosniff"
    for path in ("/jobs/_data", "/jobs/_data/hostile"):
        status, headers, body = browser.get(path)
        assert headers["content-type"].startswith("application/json")
        assert "<script>alert(1)</script>" in body  # data, for the page's esc() to escape
    detail = browser.json("/jobs/_data/hostile")
    assert HOSTILE in detail["log"] and "<script>alert(1)</script>" in detail["job"]["program"]
    # esc() covers every character that could open a tag or end an attribute value.
    for character, entity in (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"), ('"', "&quot;"), ("'", "&#39;"),
                              ("`", "&#96;")):
        assert f'"{entity}"' in LIST_PAGE and character in LIST_PAGE.split("const esc")[1].split(";")[0]
