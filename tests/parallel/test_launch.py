"""The launcher: torchrun argument mapping, a failing rank's exit code and name, and
``hybridtrain train --nproc-per-node``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hybridtrain.parallel.launch import (
    LaunchSpec,
    first_failure,
    local_ranks,
    threads_per_rank,
    torchrun_argv,
)

FAILING_SCRIPT = """
import sys
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    sys.exit(3)
dist.barrier()  # rank 0 waits here for a peer that is gone: the launcher must stop it
"""


def test_torchrun_argv_maps_each_rendezvous() -> None:
    assert torchrun_argv(LaunchSpec(nproc_per_node="2"), "s.py", ["--x"]) == [
        "--nproc-per-node=2", "--nnodes=1", "--max-restarts=0", "--standalone", "s.py", "--x"]
    static = torchrun_argv(LaunchSpec(nnodes="2", node_rank=1, master_addr="10.0.0.1", master_port=29400), "s.py", [])
    assert "--node-rank=1" in static and "--master-addr=10.0.0.1" in static and "--master-port=29400" in static
    elastic = torchrun_argv(LaunchSpec(nnodes="1:4", rdzv_endpoint="h:29400", max_restarts=3, module=True), "m", [])
    assert {"--rdzv-backend=c10d", "--rdzv-endpoint=h:29400", "--max-restarts=3", "--module"} <= set(elastic)


@pytest.mark.parametrize(("spec", "needle"), [
    (LaunchSpec(nnodes="2"), "needs --rdzv-endpoint"),
    (LaunchSpec(rdzv_endpoint="h:1", master_addr="h"), "not both"),
    (LaunchSpec(max_restarts=-1), "--max-restarts -1"),
])
def test_contradictory_options_are_refused(spec: LaunchSpec, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        spec.validate()


def _failure(tmp_path: Path, rank: int, exitcode: int, said: str | None = None) -> Any:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / f"error-{rank}.json"
    if said is not None:  # as ErrorHandler.record_exception writes it
        error_file.write_text(json.dumps({"message": {"message": said, "extraInfo": {"timestamp": "100"}}}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))


LOST = "PeerFailure: lost contact with another rank in a collective (Connection reset by peer)"


@pytest.mark.parametrize(("codes", "first"), [
    # kill -9 of rank 1: rank 0's collective lost it (an error of its own, recorded first),
    # rank 2 was stopped by the agent. The measured launcher named rank 0 or 2.
    ({0: (1, LOST), 1: (-9, None), 2: (-15, None)}, 1),
    # A rank's own error beats the ranks that lost it, whatever their exit codes.
    ({0: (1, LOST), 1: (2, "ValueError: bad batch"), 2: (-15, None)}, 1),
    ({0: (-15, None), 1: (-15, None), 2: (3, None)}, 2),
    # Nothing tells them apart: the lowest rank.
    ({0: (-15, None), 1: (-15, None)}, 0),
])
def test_the_rank_that_failed_first_is_named_not_its_victims(tmp_path: Path, codes: dict[int, tuple[int, str | None]],
                                                              first: int) -> None:
    failures = {rank: _failure(tmp_path, rank, code, said) for rank, (code, said) in codes.items()}
    assert first_failure(failures) == first


RECORDING_SCRIPT = """
import json, os, signal, time
from torch.distributed.elastic.multiprocessing.errors import record
if os.environ["RANK"] == "1":
    time.sleep(2)
    os.kill(os.getpid(), signal.SIGKILL)
write = json.dump
json.dump = lambda *a, **k: (time.sleep(60), write(*a, **k))  # torch's @record: file opened, not yet written

@record
def main():
    raise RuntimeError("rank 0 fails as well")

main()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("source", "code", "how"), [
    (FAILING_SCRIPT, 3, "exited with code 3"),
    # The agent SIGTERMs rank 0 while torch's @record has its error file open and empty,
    # then parses the file: torchrun alone exits with "Expecting value: line 1 column 1".
    (RECORDING_SCRIPT, 128 + signal.SIGKILL, "was killed by SIGKILL"),
], ids=["exits", "killed_while_the_other_records_its_error"])
def test_a_dying_rank_fails_the_launch_naming_it(source: str, code: int, how: str, tmp_path: Path) -> None:
    script = tmp_path / "die.py"
    script.write_text(source)
    proc = subprocess.run([sys.executable, "-m", "hybridtrain", "launch", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, timeout=100)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert "error: rank 1 (local rank 1" in proc.stderr and how in proc.stderr


@pytest.mark.timeout(180)
def test_train_with_nproc_per_node_writes_once(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "hybridtrain", "train", "--nproc-per-node", "2", "--steps", "2",
         "--output-dir", str(out), "--no-progress", "--set", "model.overrides.n_layer=1",
         "--set", "data.seq_len=32", "--set", "train_micro_batch_size_per_gpu=2"],
        capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("summary:") == 1  # rank 0 alone reports
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [1, 2]  # one writer: no duplicate records
    assert (out / "checkpoints" / "step-0000002" / "meta.json").exists()


def _start_two_ranks(out: Path, *extra: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridtrain", "train", "--nproc-per-node", "2", "--steps", "100000",
         "--output-dir", str(out), "--no-progress", "--set", "device=cpu", "--set", "model.overrides.n_layer=1",
         "--set", "data.seq_len=16", "--set", "train_micro_batch_size_per_gpu=2", "--set", "steps_per_print=100000",
         *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "metrics.jsonl").exists() and proc.poll() is None:
        time.sleep(0.1)
    return proc


def _ours(stderr: str) -> list[str]:
    """hybridtrain's own lines (torchrun's W/E log lines and its banner left out)."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith(("W1", "E1", "I1"))]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("sig", [signal.SIGINT])
def test_ctrl_c_or_sigterm_of_two_ranks_saves_once_and_exits_130(sig: signal.Signals, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _start_two_ranks(out)
    proc.send_signal(sig)  # to the launcher, as a terminal's Ctrl-C or a scheduler's SIGTERM
    stdout, err = proc.communicate(timeout=150)
    assert proc.returncode == 130, err[-3000:]
    saved = [p.name for p in (out / "checkpoints").iterdir()]
    step = max(r["step"] for r in (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()))
    assert saved == [f"step-{step:07d}"]  # every rank stopped after the same step and saved it once
    # One line, when the signal came (rank 0's, for the run); the summary says how it ended.
    assert _ours(err) == [f"{sig.name}: stopping after this step and saving a checkpoint (continue with --resume; "
                          "Ctrl-C again stops at once without saving)"], err[-3000:]
    assert f"steps 0→{step} (stopped early; its checkpoint is saved)" in stdout


@pytest.mark.timeout(200)
def test_workers_of_a_killed_launcher_save_once_and_exit(tmp_path: Path) -> None:
    # kill -9 of `hybridtrain train` cannot pass anything on: its workers notice they lost
    # their parent, agree on a step, save it and end, instead of training on as orphans.
    out = tmp_path / "run"
    proc = _start_two_ranks(out)
    workers = [int(pid) for pid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    proc.kill()
    proc.wait()
    deadline = time.time() + 120
    while time.time() < deadline and any(Path(f"/proc/{pid}").exists() for pid in workers):
        time.sleep(0.2)
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers), "workers outlived their launcher"
    step = max(r["step"] for r in (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()))
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step-{step:07d}"]


@pytest.mark.timeout(200)
def test_a_stuck_rank_ends_the_run_after_timeout_s_naming_it(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _start_two_ranks(out, "--set", "distributed.timeout_s=1")
    workers = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    rank1 = next(int(pid) for pid in workers if b"RANK=1\0" in Path(f"/proc/{pid}/environ").read_bytes())
    os.kill(rank1, signal.SIGSTOP)  # rank 1 stops in the middle of whatever it was doing
    time.sleep(6)  # rank 0 waits 1 s in a collective, then 3 s for the others to say they timed out too
    os.kill(rank1, signal.SIGCONT)
    _, err = proc.communicate(timeout=150)
    assert proc.returncode == 1, err[-3000:]
    assert ("error: rank 0: a collective did not finish within distributed.timeout_s = 1 s: rank 1 never "
            "reached it; raise distributed.timeout_s if that rank is only slow") in _ours(err), err[-3000:]
    assert _ours(err)[-1].startswith("error: rank 0 (local rank 0"), err[-3000:]


RESTARTING_SCRIPT = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and dist.get_rank() == 1:
    os._exit(1)  # the first round dies after its process group was made
dist.all_reduce(t)
open(os.path.join(sys.argv[1], f"round-{os.environ['TORCHELASTIC_RESTART_COUNT']}-rank-{dist.get_rank()}"), "w").close()
dist.barrier()  # neither rank exits while the other still talks to it (gloo aborts at exit then)
dist.destroy_process_group()
"""


@pytest.mark.timeout(150)
def test_a_plain_script_restarts_on_a_fresh_store(tmp_path: Path) -> None:
    # torchrun alone shares one store across rounds: the second round's gloo connects to
    # the first round's dead addresses ("connectFullMesh failed", 5 of 5 tries measured).
    script = tmp_path / "restart.py"
    script.write_text(RESTARTING_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "hybridtrain", "launch", "--nproc-per-node", "2",
                           "--max-restarts", "1", str(script), str(tmp_path)], capture_output=True, text=True,
                          timeout=140)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("round-*")) == ["round-1-rank-0", "round-1-rank-1"]


@pytest.mark.parametrize(("cores", "nproc", "threads"), [(16, 4, 4), (16, 3, 5), (2, 4, 1), (8, 1, 8)])
def test_each_rank_gets_its_share_of_the_cores(cores: int, nproc: int, threads: int) -> None:
    assert threads_per_rank(cores, nproc) == threads


@pytest.mark.timeout(60)
@pytest.mark.parametrize("user_value", [None, "1"])
def test_ranks_run_the_host_step_on_their_cores_unless_the_user_said(user_value: str | None,
                                                                     tmp_path: Path) -> None:
    # torchrun pins every rank to one thread when it starts several; the launcher hands out
    # the cores this process may use instead, and an OMP_NUM_THREADS the user set wins.
    script = tmp_path / "threads.py"
    script.write_text("import os, torch\nprint('THREADS', os.environ['OMP_NUM_THREADS'], torch.get_num_threads())\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if user_value is not None:
        env["OMP_NUM_THREADS"] = user_value
    proc = subprocess.run([sys.executable, "-m", "hybridtrain", "launch", "--nproc-per-node", "1",
                           str(script)], capture_output=True, text=True, timeout=50, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    expected = user_value or str(len(os.sched_getaffinity(0)))
    assert f"THREADS {expected} {expected}" in proc.stdout


@pytest.mark.parametrize(("nproc", "ranks"), [("3", 3), ("cpu", 16), ("auto", 16)])
def test_local_ranks_follow_torchruns_words_on_a_cpu_node(nproc: str, ranks: int) -> None:
    assert local_ranks(nproc, cores=16) == ranks
