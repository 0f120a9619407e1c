"""The services' bearer token: generated once into a private file, refused when short."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridtrain.server.auth import bearer, resolve_token, token_matches
from hybridtrain.server.errors import ServerError


def test_token_is_generated_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYBRIDTRAIN_HPO_TOKEN", raising=False)
    path = tmp_path / "token"
    token, created = resolve_token(path)
    assert created and len(token) >= 32 and path.stat().st_mode & 0o777 == 0o600
    assert resolve_token(path) == (token, False)
    monkeypatch.setenv("HYBRIDTRAIN_HPO_TOKEN", "short")
    with pytest.raises(ServerError, match="at least 16 characters"):
        resolve_token(path)


def test_the_token_comes_from_the_header_or_the_login_cookie() -> None:
    assert bearer([(b"authorization", b"Bearer abc ")]) == "abc"
    assert bearer([(b"cookie", b"other=1; hybridtrain_hpo_token=xyz")]) == "xyz"
    assert bearer([(b"authorization", b"Basic abc")]) is None
    assert token_matches("abc", "abc") and not token_matches("abc", "abd")
    assert not token_matches("abc", None)
