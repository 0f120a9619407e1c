"""Per-trial overhead of the HPO service against a bare Optuna loop, measured in one run.

Service: an experiment of trivial trials (``echo loss=${x}``, random search, SQLite,
``parallel_trials: 1``, every durability setting at its default) run by
:class:`hybridtrain.hpo.controller.Controller` -- slots, leases, heartbeat, trial
processes, metrics parsing, user attributes. Baseline: the loop a user would write
without it, ``study.ask()`` / ``suggest_float`` / ``subprocess.run`` of the same command
/ ``study.tell`` on Optuna's RDB storage on SQLite with its default settings. The trial
process starts the same way in both: the service runs a command that needs no shell
without one (:func:`hybridtrain.hpo.shell.argv_without_shell`), so the baseline runs
the same argument vector, and the ratio holds the service's bookkeeping only.

A third loop, "baseline, service's SQLite settings", is the same bare loop on a storage
opened the way the service opens its own (WAL, ``synchronous=NORMAL``): it tells how
much of the difference is those settings rather than the service's own work.

The loops alternate in rounds on fresh databases, each round in a different order, so
load from other processes on the machine hits all alike; per loop the median of the
rounds' ms/trial is reported, and the median of the per-round ratios. Each loop's first
and second half of the trials are timed apart (flat = no growth with the trial count).
The CPU time of the loop's own process (not of the trials) is printed too: on a loaded
machine it varies much less than wall-clock time.

Usage: ``python benchmarks/hpo_overhead.py [--trials 100] [--rounds 5] [--profile]``;
``--trials 1000 --rounds 1`` for the flatness check; ``--profile`` prints where the
service's time goes (cProfile, top 30).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import shlex
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import optuna

from hybridtrain.hpo.controller import Controller
from hybridtrain.hpo.shell import argv_without_shell
from hybridtrain.hpo.spec import load_spec
from hybridtrain.hpo.storage import open_optuna_storage
from hybridtrain.server.storage import open_engine

COMMAND = "echo loss=${x}"


def run_service(trials: int, workdir: Path, profile: cProfile.Profile | None = None
                ) -> tuple[list[float], float]:
    """Run one service experiment.

    Returns:
        The start time and every trial's end time; the CPU seconds of this process
        between the first and the last (set-up excluded, as from the times).
    """
    spec = load_spec({
        "name": "overhead", "objective": {"metric": "loss"},
        "parameters": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
        "algorithm": {"name": "random", "seed": 0},
        "trial": {"command": COMMAND}, "max_trials": trials,
        "output_dir": str(workdir / "runs")})
    done: list[float] = []
    controller = Controller(spec, f"sqlite:///{workdir / 'service.db'}",
                            on_event=lambda line: done.append(time.perf_counter())
                            if " complete:" in line else None)
    start, cpu = time.perf_counter(), time.process_time()
    if profile is not None:
        profile.enable()
    controller.run()
    cpu = time.process_time() - cpu  # includes the last trial's clean-up: at most 1 of N
    if profile is not None:
        profile.disable()
    if len(done) != trials:
        raise SystemExit(f"service finished {len(done)} of {trials} trials")
    return [start, *done], cpu


def _trial_args(x: float) -> tuple[list[str] | str, bool]:
    """What the service starts for value ``x``: an argument vector, else a shell line."""
    argv = argv_without_shell(COMMAND, {"x": str(x)}, os.environ.get("PATH"), os.getcwd())
    if argv is not None:
        return argv, False
    return COMMAND.replace("${x}", shlex.quote(str(x))), True


def run_baseline(trials: int, workdir: Path, service_settings: bool = False
                 ) -> tuple[list[float], float]:
    """The bare ask/tell + subprocess loop; returns what :func:`run_service` returns.

    Args:
        service_settings: open the storage as the service does (WAL, synchronous=NORMAL)
            instead of with Optuna's defaults.
    """
    url = f"sqlite:///{workdir / 'baseline.db'}"
    if service_settings:
        open_engine(url).dispose()  # switches the file to WAL
        storage = open_optuna_storage(url)
    else:
        storage = optuna.storages.RDBStorage(url)
    study = optuna.create_study(storage=storage, sampler=optuna.samplers.RandomSampler(0))
    times, cpu = [time.perf_counter()], time.process_time()
    for _ in range(trials):
        trial = study.ask()
        x = trial.suggest_float("x", 0.0, 1.0)
        args, shell = _trial_args(x)
        out = subprocess.run(args, shell=shell, capture_output=True, text=True, check=True)
        study.tell(trial, float(out.stdout.split("=")[1]))
        times.append(time.perf_counter())
    return times, time.process_time() - cpu


def per_trial_ms(times: list[float]) -> float:
    """Mean ms per trial of a start time followed by trial end times."""
    return (times[-1] - times[0]) / (len(times) - 1) * 1e3


def halves_ms(times: list[float]) -> tuple[float, float]:
    """Ms per trial of the first and of the second half of the trials."""
    half = (len(times) - 1) // 2
    return per_trial_ms(times[:half + 1]), per_trial_ms(times[half:])


LOOPS: dict[str, Callable[[int, Path], tuple[list[float], float]]] = {
    "service": run_service,
    "baseline": run_baseline,
    "baseline, service's SQLite settings": lambda n, d: run_baseline(n, d, True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=100, help="trials per loop and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    shell = "shell" if _trial_args(0.5)[1] else "no shell"
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.2f}, optuna {optuna.__version__}, python "
          f"{platform.python_version()}; trial {COMMAND!r} ({shell} in every loop)")
    names = list(LOOPS)
    ms: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    halves: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            with tempfile.TemporaryDirectory() as tmp:
                times, cpu_s = LOOPS[name](args.trials, Path(tmp))
            cpu[name].append(cpu_s / args.trials * 1e3)
            ms[name].append(per_trial_ms(times))
            halves[name].append(halves_ms(times))
    print(f"{args.rounds} round(s) of {args.trials} trivial trials per loop, SQLite, "
          "parallel_trials=1 (median ms/trial; rounds; first/second half of the trials)")
    for name in names:
        first = statistics.median(h[0] for h in halves[name])
        second = statistics.median(h[1] for h in halves[name])
        print(f"  {name:37s} {statistics.median(ms[name]):6.2f} ms/trial (rounds: "
              f"{', '.join(f'{v:.1f}' for v in ms[name])}; halves {first:.1f} / "
              f"{second:.1f}, growth {second / first:.2f}x); its own CPU "
              f"{statistics.median(cpu[name]):.2f} ms/trial")
    for name in names[1:]:
        ratios = [s / b for s, b in zip(ms["service"], ms[name], strict=True)]
        cpu_ratios = [s / b for s, b in zip(cpu["service"], cpu[name], strict=True)]
        print(f"  ratio service / {name}: median {statistics.median(ratios):.3f}x "
              f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)})"
              + ("; goal <= 1.10x" if name == "baseline" else "")
              + f"; CPU of the loop's process {statistics.median(cpu_ratios):.3f}x")
    if args.profile:
        profile = cProfile.Profile()
        with tempfile.TemporaryDirectory() as tmp:
            run_service(args.trials, Path(tmp), profile)
        pstats.Stats(profile).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
