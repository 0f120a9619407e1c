"""Drive the jobs page in a real headless Chromium (issue #35) and print each check: the checks
of ``tests/service/browser.py`` (the test ``tests/service/test_page_browser.py`` runs the same).

Needs ``chromium`` on ``PATH`` (Debian: ``apt-get install chromium``) and ``websocket-client``.
Run from the repository root: ``python scripts/browser_check_page.py``; exit 0 when every check
passed, 1 otherwise.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.service.browser import check_page  # noqa: E402 - after the repository is on the path


def main() -> int:
    """Run every check; print each; 0 when all passed."""
    with tempfile.TemporaryDirectory() as tmp:
        results = check_page(Path(tmp))
    for what, passed in results:
        print(f"{'ok  ' if passed else 'FAIL'} {what}")
    return 0 if all(passed for _, passed in results) else 1


if __name__ == "__main__":
    sys.exit(main())
