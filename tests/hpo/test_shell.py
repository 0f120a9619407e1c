"""A trial command that needs no shell runs without one, with the arguments the shell
would have given it; anything the shell would treat specially still goes to the shell."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hybridtrain.hpo.schema import render_command
from hybridtrain.hpo.shell import argv_without_shell

PATH = os.environ.get("PATH")
# Values a categorical parameter may take, each meaning something to a shell.
AWKWARD = ["two words", "*", "$HOME", "x'; rm -rf ~; '", "back\\slash", "", "-n", "~",
           "semi;colon", "new\nline", "${b}", "0.001"]


def _argv_printer(tmp_path: Path) -> Path:
    script = tmp_path / "argv.py"
    script.write_text(f"#!{sys.executable} -S\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    script.chmod(0o755)
    return script


@pytest.mark.parametrize("value", AWKWARD)
def test_direct_argv_equals_what_the_shell_passes(tmp_path: Path, value: str) -> None:
    command = f"{_argv_printer(tmp_path)} --a=${{a}} ${{a}} plain ${{b}}"
    values = {"a": value, "b": "0.5"}
    argv = argv_without_shell(command, values, PATH, str(tmp_path))
    assert argv is not None
    direct = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    line = render_command(command, {k: shlex.quote(v) for k, v in values.items()})
    shell = subprocess.run(line, shell=True, capture_output=True, text=True, check=True).stdout
    assert json.loads(direct) == json.loads(shell) == [f"--a={value}", value, "plain", "0.5"]


@pytest.mark.parametrize("command", [
    "python train.py | tee log", "python train.py > out.log", "cd /tmp && python t.py",
    "python a.py; python b.py", "FOO=1 python t.py", "python t.py $HOME", "python 't.py'",
    'python "t.py"', "python *.py", "python t.py # note", "~/bin/train", "exit 3",
    "cd ${x}", "no-such-program-xyz --x ${x}", "python t.py\npython u.py", "",
    "python t.py `date`", "python t.py {a,b}", "python \\t.py",
])
def test_commands_that_need_the_shell(command: str) -> None:
    assert argv_without_shell(command, {"x": "1"}, PATH, "/") is None


def test_program_paths_resolve_from_the_trial_directory(tmp_path: Path) -> None:
    tool = tmp_path / "tool"
    tool.write_text("#!/bin/sh\necho loss=1\n")
    assert argv_without_shell("./tool ${x}", {"x": "1"}, PATH, str(tmp_path)) is None
    tool.chmod(0o755)
    assert argv_without_shell("./tool ${x}", {"x": "1"}, PATH, str(tmp_path)) == ["./tool", "1"]
    # Found on PATH, not next to the controller: the PATH the trial runs with counts.
    assert argv_without_shell("tool ${x}", {"x": "1"}, str(tmp_path), "/") == ["tool", "1"]
    assert argv_without_shell("tool ${x}", {"x": "1"}, "/nonexistent", "/") is None
