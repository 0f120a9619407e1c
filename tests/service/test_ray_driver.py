"""The Ray driver's command line per node: hybridtrain's launchers get the rendezvous as
options, any other program only as variables."""

from __future__ import annotations

from pathlib import Path

from hybridtrain.service.ray_driver import node_argv
from hybridtrain.service.spec import load_job_spec

RENDEZVOUS = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29500"]


def test_launch_takes_the_rendezvous_before_the_script() -> None:
    spec = load_job_spec({"name": "s", "command": ["train.py", "--lr", "1"], "devices": 2, "nodes": 2,
                          "backend": "ray"})
    argv = spec.program(Path("run"), python="py")
    assert argv == ["py", "-m", "hybridtrain", "launch", "--nproc-per-node", "2", "train.py", "--lr", "1"]
    assert node_argv(argv, 2, 1, "10.0.0.1", 29500, 2) == [
        "py", "-m", "hybridtrain", "launch", *RENDEZVOUS, "--nproc-per-node", "2", "train.py", "--lr", "1"]


def test_train_takes_it_at_the_end_and_other_programs_not_at_all() -> None:
    train = ["py", "-m", "hybridtrain", "train", "cfg.yaml", "--resume"]
    assert node_argv(train, 2, 1, "10.0.0.1", 29500, 3) == [*train, *RENDEZVOUS, "--nproc-per-node", "3"]
    assert node_argv(train, 1, 0, "10.0.0.1", 29500, 3) == train  # one node: nothing to meet
    other = ["py", "-m", "hybridtrain", "report", "run"]
    assert node_argv(other, 2, 1, "10.0.0.1", 29500, 1) == other
