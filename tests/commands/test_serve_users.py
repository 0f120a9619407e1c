"""``hybridtrain serve users add|revoke|list``: a token shown once, one line per refusal."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridtrain.commands.cli import main
from hybridtrain.service.users import User, UserStore


def test_serve_users_issues_lists_and_revokes_in_one_line_each(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    storage = ["--storage", f"sqlite:///{tmp_path / 's.db'}"]
    assert main(["serve", "users", "add", "alice", "--devices", "2", *storage]) == 0
    token = capsys.readouterr().out.splitlines()[1]
    assert UserStore(storage[1]).find(token) == User("alice", False, 2)
    assert main(["serve", "users", "list", *storage]) == 0
    assert capsys.readouterr().out.splitlines()[1].split() == ["alice", "user", "2"]
    assert main(["serve", "users", "add", "Alice", *storage]) == 2
    assert capsys.readouterr().err.startswith("error: user name 'Alice'")
    assert main(["serve", "users", "revoke", "alice", *storage]) == 0
    assert UserStore(storage[1]).find(token) is None
    assert main(["serve", "users", "revoke", "alice", *storage]) == 2
    assert capsys.readouterr().err.count("\n") == 1
