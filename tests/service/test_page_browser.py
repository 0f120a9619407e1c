"""The jobs page in a real headless Chromium (issue #35), driven over the DevTools protocol: the
printed address lists a running job, its own page shows it with its loss and eval-loss curves
side by side, cancel asks and cancels, hostile output stays text, jobs are grouped under their
experiment and the filter keeps one group, and the Content-Security-Policy is never violated (the checks are in
``tests/service/browser.py``; ``scripts/browser_check_page.py`` prints them one by one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.service.browser import check_page, chromium

pytest.importorskip("websocket", reason="websocket-client is not installed (the dev extra has it)")
pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(chromium() is None,
                                 reason="no chromium on PATH (Debian: apt-get install chromium; .ci/chromium.sh)")]


def test_the_page_in_a_real_browser(tmp_path: Path) -> None:
    results = check_page(tmp_path)
    failed = [what for what, passed in results if not passed]
    assert not failed, f"{len(failed)} of {len(results)} browser checks failed: {failed}"
    assert len(results) >= 16
