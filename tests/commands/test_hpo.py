"""The ``hpo`` commands, called through their own parser."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hybridtrain.commands.hpo import add_hpo_commands, main
from tests.hpo.conftest import REPO

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def finished(make_spec: Any, sqlite_url: str, tmp_path: Path,
             capsys: pytest.CaptureFixture[str]) -> tuple[Path, str]:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(make_spec(max_trials=4)))
    assert main(["run", str(spec), "--storage", sqlite_url]) == 0
    capsys.readouterr()
    return spec, sqlite_url


def test_commands_register_on_a_parent_parser() -> None:
    parser = argparse.ArgumentParser(prog="hybridtrain")
    add_hpo_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["hpo", "serve"])
    assert (args.host, args.port, callable(args.func)) == ("127.0.0.1", 8080, True)
    for cmd in (["run", "s.yaml"], ["worker", "s.yaml"], ["status", "n", "--json"],
                ["best", "n"], ["list"], ["stop", "n"], ["report", "n", "--format", "html"]):
        assert callable(parser.parse_args(["hpo", *cmd]).func)


def test_status_best_list_json(finished: tuple[Path, str],
                               capsys: pytest.CaptureFixture[str]) -> None:
    _, url = finished
    assert main(["status", "branin", "--json", "--storage", url]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["state"] == "succeeded"
    assert status["trials"] == {"complete": 4, "pruned": 0, "failed": 0, "running": 0,
                                "waiting": 0}
    assert main(["best", "branin", "--json", "--storage", url]) == 0
    best = json.loads(capsys.readouterr().out)
    assert set(best) == {"value", "params", "trial"} and set(best["params"]) == {"x1", "x2"}
    assert main(["list", "--storage", url]) == 0
    assert capsys.readouterr().out.startswith("branin\tsucceeded\tcomplete=4")


def test_report_png_and_html(finished: tuple[Path, str], tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    _, url = finished
    assert main(["report", "branin", "--out", str(tmp_path / "r"), "--storage", url]) == 0
    written = capsys.readouterr().out.split()
    names = {Path(p).name for p in written}
    assert {"optimization_history.png", "parallel_coordinate.png",
            "intermediate_values.png", "param_importances.png"} == names
    assert all(Path(p).read_bytes().startswith(b"\x89PNG") for p in written)
    assert main(["report", "branin", "--format", "html", "--out", str(tmp_path / "h"),
                 "--storage", url]) == 0
    page = (tmp_path / "h" / "report.html").read_text()
    assert page.count("data:image/png;base64") == 4 and "best trial" in page


def test_errors_are_one_line_with_exit_code_2(tmp_path: Path, sqlite_url: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "nope", "--storage", sqlite_url]) == 2
    assert capsys.readouterr().err == "error: experiment 'nope' not found; known: none\n"
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nobjective: {metric: loss}\nparameters: {}\n"
                   "trial: {command: run}\nmax_trials: 1\n")
    assert main(["run", str(bad), "--storage", sqlite_url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'parameters'" in err
    assert main(["run", str(bad), "--storage", "postgresql://u@127.0.0.1:1/x"]) == 2


def test_stop_of_an_idle_experiment(make_spec: Any, sqlite_url: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    from hybridtrain.hpo.experiments import ExperimentStore
    from hybridtrain.hpo.spec import load_spec

    ExperimentStore(sqlite_url).create(load_spec(make_spec()))
    assert main(["stop", "branin", "--storage", sqlite_url]) == 0
    assert capsys.readouterr().out == "branin: stopped\n"


def test_module_entry_point_help_is_fast_and_light() -> None:
    code = ("import sys, hybridtrain.commands.hpo; "
            "print(any(m.startswith(('optuna', 'fastapi', 'sqlalchemy')) for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
