"""The jobs page at the very address ``hybridtrain serve`` prints, as a browser opens it:
redirects followed, the login cookie kept, the page and its data served."""

from __future__ import annotations

import http.cookiejar
import urllib.request

import pytest

from tests.service.conftest import TOKEN

pytestmark = pytest.mark.timeout(120)


def test_the_printed_page_address_opens_the_jobs_page(served: dict[str, str]) -> None:
    address = served["jobs page"]
    assert address.endswith("/jobs?token=<token>"), address
    browser = urllib.request.build_opener(
        urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
    with browser.open(address.replace("<token>", TOKEN), timeout=30) as response:
        assert response.status == 200
        assert response.url.rstrip("/").endswith("/jobs")  # the token left the address
        assert "<h1>hybridtrain jobs</h1>" in response.read().decode()
    with browser.open(f"{served['base']}/jobs/_data", timeout=30) as response:  # the page's fetch
        assert response.status == 200 and b'"jobs":[]' in response.read()
