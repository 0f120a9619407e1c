"""A real ``hybridtrain serve --port 0`` on one CPU slot, for the tests and for
``scripts/browser_check_page.py`` (no pytest here, so the script can use it too)."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOKEN = "service-test-token-0123456789"


@contextmanager
def serving(workdir: Path, token: str = TOKEN) -> Iterator[dict[str, str]]:
    """Start ``serve`` with its storage and jobs under ``workdir``; yield what it printed, by
    label (``"jobs page"``: the page address...) plus ``"base"`` (its address), once it
    answers; stop it on exit."""
    from hybridtrain.service.transport import healthy

    env = os.environ | {"HYBRIDTRAIN_HPO_TOKEN": token, "PYTHONPATH": str(REPO),
                        "HYBRIDTRAIN_SERVICE_DEVICES": "cpu:1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridtrain", "serve", "--port", "0", "--storage",
         f"sqlite:///{workdir / 's.db'}", "--jobs-dir", str(workdir / "jobs")],
        env=env, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        printed: dict[str, str] = {}
        assert proc.stdout is not None
        while "devices" not in printed:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"serve exited ({proc.poll()})")
            label, sep, rest = line.partition(":")
            if sep:
                printed[label] = rest.strip()
        printed["base"] = printed["jobs page"].split("/jobs")[0]
        # Keep reading what it prints: a pipe nobody drains fills (64 KiB) and then blocks
        # the service at its next log line, jobs and all.
        threading.Thread(target=collections.deque, args=(proc.stdout, 0), daemon=True).start()
        deadline = time.monotonic() + 60
        while not healthy(printed["base"]):
            if time.monotonic() > deadline:
                raise RuntimeError("serve did not answer within 60 s")
            time.sleep(0.1)
        yield printed
    finally:
        proc.terminate()
        proc.wait(30)
