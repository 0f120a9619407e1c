"""Kill-and-restart soak: ``kill -9`` a random worker of a multi-rank ``hybridtrain train``
at a random moment, let torchrun restart the group, and check the run resumed exactly.

    python scripts/restart_soak.py [--cycles 20] [--nproc 2] [--steps 10] [--moments startup,step,checkpoint]
                                   [--scale-down]

One uninterrupted run is the reference. Each cycle then starts the same run with
``--max-restarts 1`` (no ``--resume``), kills one worker (chosen at random) at a moment of
the chosen kind, and waits for the launcher:

- ``startup``: at a random time before the first step finished (imports, rendezvous,
  process-group creation, model build);
- ``step``: a random few milliseconds after step k (random) was logged: inside the next
  step's forward/backward and its gradient all-reduce;
- ``checkpoint``: while a checkpoint is being written (a ``.tmp`` directory exists under
  ``checkpoints/``) or right after one appeared (ranks in the save's last barrier, the
  writer pruning old ones);
- ``random``: uniformly in the reference run's wall time.

A cycle *resumed exactly* when the launcher exits 0, the per-step losses in
``metrics.jsonl`` equal the reference run's bit for bit, and so does the final evaluation
loss (a function of every parameter). Anything else is reported with its reason (exit
code and last stderr line, loss mismatch, hang past ``--timeout``). The last line is
``resumed exactly: N/M``; the exit code is 0 only when every cycle did.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MOMENTS = ("startup", "step", "checkpoint", "random")


@dataclass
class Cycle:
    """What one kill-and-restart cycle did and how it ended."""

    moment: str
    victim: int | None
    kill_at_s: float | None
    ok: bool
    reason: str
    seconds: float


def train_command(out: Path, steps: int, nproc: int, restarts: int) -> list[str]:
    """The ``hybridtrain train`` command line of the soak's run (a small reference GPT)."""
    return [sys.executable, "-m", "hybridtrain", "train", "--nproc-per-node", str(nproc),
            "--max-restarts", str(restarts), "--steps", str(steps), "--output-dir", str(out), "--no-progress",
            "--set", "device=cpu", "--set", "model.overrides.n_layer=2", "--set", "data.seq_len=32",
            "--set", "train_micro_batch_size_per_gpu=2", "--set", "train.checkpoint_every=2",
            "--set", "train.keep_checkpoints=2", "--set", "train.eval_batches=2", "--set", "steps_per_print=1000"]


def losses(out: Path) -> tuple[list[tuple[int, float]], float | None]:
    """``(step, loss)`` of every training record in ``out/metrics.jsonl`` in file order (a
    step recorded twice shows), and the last evaluation loss."""
    steps: list[tuple[int, float]] = []
    evaluated = None
    path = out / "metrics.jsonl"
    if not path.exists():
        return steps, None
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            steps.append((record["step"], record["loss"]))
        if "eval_loss" in record:
            evaluated = record["eval_loss"]
    return steps, evaluated


def workers(launcher: int) -> list[int]:
    """Pids of the worker processes torchrun started (children running hybridtrain)."""
    found = []
    try:
        children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    except OSError:
        return []
    for pid in map(int, children):
        try:
            if b"hybridtrain" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found


def logged_steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    try:
        return sum(1 for line in path.read_text().splitlines() if '"loss"' in line)
    except OSError:
        return 0


def saved(out: Path) -> list[Path]:
    """The checkpoint directories under ``out`` (complete or not)."""
    return list((out / "checkpoints").glob("step-*"))


def saving(out: Path) -> bool:
    """Whether a checkpoint is being written (a temporary directory exists)."""
    try:
        return any(".tmp" in entry.name for entry in os.scandir(out / "checkpoints"))
    except OSError:
        return False


def run_cycle(out: Path, args: argparse.Namespace, moment: str, reference: list[tuple[int, float]],
              reference_eval: float | None, wall_s: float, rng: random.Random) -> Cycle:
    """One cycle: start, kill a worker at ``moment``, wait, compare with the reference."""
    shutil.rmtree(out, ignore_errors=True)
    start = time.monotonic()
    out.mkdir(parents=True)
    log = open(out / "launcher.log", "w+", encoding="utf-8")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(train_command(out, args.steps, args.nproc, 1), stdout=log, stderr=log, text=True,
                            env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    victim, kill_at, had_checkpoint, seen = None, None, False, 0
    deadline = start + args.timeout
    target_step = rng.randint(0, max(0, args.steps - 2))
    delay = rng.uniform(0.0, 0.05)
    startup_at = rng.uniform(0.3, max(0.4, 0.9 * args.first_step_s))
    random_at = rng.uniform(0.3, wall_s)
    while victim is None and proc.poll() is None and time.monotonic() < deadline:
        now = time.monotonic() - start
        pids = workers(proc.pid)
        ready = len(pids) == args.nproc and (
            (moment == "startup" and (now >= startup_at or logged_steps(out) > 0))
            or (moment == "random" and now >= random_at)
            or (moment == "step" and logged_steps(out) > target_step)
            or (moment == "checkpoint" and (saving(out) or len(saved(out)) > seen)))
        if ready:
            if moment == "step":
                time.sleep(delay)
            victim = rng.choice(pids)
            kill_at = time.monotonic() - start
            had_checkpoint = bool(saved(out))
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                victim = None  # it had just finished; try again
        else:
            seen = len(saved(out))
            time.sleep(0.0005 if moment == "checkpoint" else 0.01)
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        # Workers run with PYTHONFAULTHANDLER: SIGABRT writes where each one hangs to the log.
        for pid in workers(proc.pid):
            os.kill(pid, signal.SIGABRT)
        time.sleep(2.0)
        for pid in [*workers(proc.pid), proc.pid]:
            os.kill(pid, signal.SIGKILL)
        proc.wait()
        log.close()
        return Cycle(moment, victim, kill_at, False, f"hang: no exit in {args.timeout:.0f} s",
                     time.monotonic() - start)
    seconds = time.monotonic() - start
    log.seek(0)
    err = log.read()
    log.close()
    if victim is None:
        return Cycle(moment, None, None, False, "no kill: the run ended before the moment came", seconds)
    if proc.returncode != 0:
        last = next((line for line in reversed(err.splitlines()) if line.strip()), "")
        return Cycle(moment, victim, kill_at, False, f"exit {proc.returncode}: {last[-300:]}", seconds)
    got, got_eval = losses(out)
    if got != reference:
        return Cycle(moment, victim, kill_at, False, f"losses differ: {got} != {reference}", seconds)
    if had_checkpoint and "resume: continuing from" not in err:
        return Cycle(moment, victim, kill_at, False, "a checkpoint existed but the restart did not resume", seconds)
    if got_eval != reference_eval:
        return Cycle(moment, victim, kill_at, False, f"eval loss {got_eval} != {reference_eval}", seconds)
    return Cycle(moment, victim, kill_at, True, "resumed exactly", seconds)


def scale_down(root: Path, args: argparse.Namespace, reference: list[tuple[int, float]]) -> Cycle:
    """Elastic scale-down: two single-process "nodes" (``--nnodes 1:2``, c10d rendezvous);
    one node dies (launcher and worker ``kill -9``ed) after step 4; the other restarts
    alone, resumes from the newest checkpoint with twice the gradient accumulation (same
    global batch) and must reproduce the two-process losses (rtol 1e-4: the sums run in
    another order)."""
    out = root / "scale-down"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = train_command(out, args.steps, 1, 1)
    at = command.index("--nproc-per-node")
    command[at:at + 2] = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    start = time.monotonic()
    logs = [open(out / f"node-{i}.log", "w", encoding="utf-8") for i in range(2)]  # noqa: SIM115
    survivor = subprocess.Popen(command, stdout=logs[0], stderr=logs[0])
    time.sleep(2.0)  # the survivor hosts the rendezvous
    victim = subprocess.Popen(command, stdout=logs[1], stderr=logs[1])
    deadline = start + args.timeout
    while logged_steps(out) < 4 and time.monotonic() < deadline and survivor.poll() is None:
        time.sleep(0.02)
    kill_at = time.monotonic() - start
    for pid in [victim.pid, *workers(victim.pid)]:
        os.kill(pid, signal.SIGKILL)
    victim.wait()
    try:
        survivor.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for pid in [*workers(survivor.pid), survivor.pid]:
            os.kill(pid, signal.SIGKILL)
        survivor.wait()
        return Cycle("scale_down", victim.pid, kill_at, False, "hang", time.monotonic() - start)
    finally:
        for log in logs:
            log.close()
    seconds = time.monotonic() - start
    if survivor.returncode != 0:
        return Cycle("scale_down", victim.pid, kill_at, False, f"exit {survivor.returncode}", seconds)
    got, _ = losses(out)
    if [s for s, _ in got] != [s for s, _ in reference] or any(
            abs(a - b) > 1e-4 * abs(b) for (_, a), (_, b) in zip(got, reference, strict=True)):
        return Cycle("scale_down", victim.pid, kill_at, False, f"losses differ: {got} != {reference}", seconds)
    raised = "gradient_accumulation_steps" in (out / "node-0.log").read_text()
    return Cycle("scale_down", victim.pid, kill_at, raised, "2 → 1 processes, same losses (rtol 1e-4)"
                 if raised else "accumulation not raised", seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--moments", default="startup,step,checkpoint",
                        help=f"comma-separated kinds, used in turn ({', '.join(MOMENTS)})")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds before a cycle counts as a hang")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="where the runs go (default: a temporary directory)")
    parser.add_argument("--scale-down", action="store_true",
                        help="also one elastic scale-down cycle (--nnodes 1:2, one node killed; needs --nproc 2)")
    args = parser.parse_args(argv)
    moments = args.moments.split(",")
    unknown = sorted(set(moments) - set(MOMENTS))
    if unknown:
        parser.error(f"--moments {','.join(unknown)}: allowed are {', '.join(MOMENTS)}")
    rng = random.Random(args.seed)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="restart-soak-"))
    root.mkdir(parents=True, exist_ok=True)

    t0 = time.monotonic()
    ref = subprocess.Popen(train_command(root / "reference", args.steps, args.nproc, 0), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    args.first_step_s = None  # startup kills land before the reference's first logged step
    while ref.poll() is None:
        if args.first_step_s is None and logged_steps(root / "reference"):
            args.first_step_s = time.monotonic() - t0
        time.sleep(0.01)
    wall_s = time.monotonic() - t0
    output = ref.communicate()[0]
    if ref.returncode != 0 or args.first_step_s is None:
        print(f"reference run failed (exit {ref.returncode}): {output[-2000:]}", file=sys.stderr)
        return 2
    reference, reference_eval = losses(root / "reference")
    print(f"reference: {args.nproc} ranks, {args.steps} steps in {wall_s:.1f} s; "
          f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"python {platform.python_version()}", flush=True)

    cycles = []
    for i in range(args.cycles):
        moment = moments[i % len(moments)]
        cycle = run_cycle(root / f"cycle-{i:02d}", args, moment, reference, reference_eval, wall_s, rng)
        cycles.append(cycle)
        at = f"{cycle.kill_at_s:5.2f} s" if cycle.kill_at_s is not None else "   -   "
        print(f"cycle {i + 1:2d}/{args.cycles} {moment:10s} kill pid {cycle.victim} at {at}: "
              f"{'ok ' if cycle.ok else 'FAIL'} {cycle.reason} ({cycle.seconds:.1f} s)", flush=True)
    if args.scale_down:
        cycle = scale_down(root, args, reference)
        cycles.append(cycle)
        print(f"scale-down: node killed at {cycle.kill_at_s:.2f} s: {'ok ' if cycle.ok else 'FAIL'} "
              f"{cycle.reason} ({cycle.seconds:.1f} s)", flush=True)
    good = sum(c.ok for c in cycles)
    by_moment = {m: f"{sum(c.ok for c in cycles if c.moment == m)}/{sum(c.moment == m for c in cycles)}"
                 for m in dict.fromkeys(c.moment for c in cycles)}
    print(f"by moment: {', '.join(f'{m} {v}' for m, v in by_moment.items())}")
    print(f"resumed exactly: {good}/{len(cycles)}")
    if not args.workdir:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if good == len(cycles) else 1


if __name__ == "__main__":
    sys.exit(main())
