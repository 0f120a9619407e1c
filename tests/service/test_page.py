"""The jobs page at the very address ``hybridtrain serve`` prints, as a browser opens it:
redirects followed, the login cookie kept, the page and its data served."""

from __future__ import annotations

import http.cookiejar
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridtrain.service.client import healthy
from tests.service.conftest import REPO, TOKEN

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def printed_page_address(tmp_path: Path) -> Iterator[str]:
    """Start ``hybridtrain serve --port 0``; the jobs page address it prints."""
    env = os.environ | {"HYBRIDTRAIN_HPO_TOKEN": TOKEN, "PYTHONPATH": str(REPO),
                        "HYBRIDTRAIN_SERVICE_DEVICES": "cpu:1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridtrain.cli", "serve", "--port", "0", "--storage",
         f"sqlite:///{tmp_path / 's.db'}", "--jobs-dir", str(tmp_path / "jobs")],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        address = None
        assert proc.stdout is not None
        while address is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, f"serve exited ({proc.poll()})"
            if line.startswith("jobs page:"):
                address = line.split()[-1]
        assert address is not None
        base = address.split("/jobs")[0]
        while not healthy(base) and time.monotonic() < deadline:
            time.sleep(0.1)
        yield address
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_printed_page_address_opens_the_jobs_page(printed_page_address: str) -> None:
    assert printed_page_address.endswith("/jobs?token=<token>"), printed_page_address
    browser = urllib.request.build_opener(
        urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
    url = printed_page_address.replace("<token>", TOKEN)
    with browser.open(url, timeout=30) as response:
        assert response.status == 200
        assert response.url.rstrip("/").endswith("/jobs")  # the token left the address
        assert "<h1>hybridtrain jobs</h1>" in response.read().decode()
    base = url.split("/jobs")[0]
    with browser.open(f"{base}/jobs/data", timeout=30) as response:  # the page's own fetch
        assert response.status == 200 and b'"jobs":[]' in response.read()
