"""Per-trial overhead of the HPO service against a bare Optuna loop, measured in one run.

Service: an experiment of trivial trials (``echo loss=${x}``, random search, SQLite,
``parallel_trials: 1``) run by :class:`hybridtrain.hpo.controller.Controller` -- slots,
leases, heartbeat, trial processes, metrics parsing, user attributes. Baseline: the loop
a user would write without it, ``study.ask()`` / ``suggest_float`` / ``subprocess.run``
of the same command / ``study.tell`` on an Optuna RDB storage on SQLite.

The two alternate in rounds (service, baseline, service, …) on fresh databases, so load
from other processes on the machine hits both alike; the ratio reported is the median of
the per-round ratios. ``--flat N`` also runs one experiment of N trials and compares the
per-trial time of its first and second halves (flat = no growth with the trial count).

Usage: ``python benchmarks/hpo_overhead.py [--trials 200] [--rounds 5] [--flat 1000]
[--profile]``; ``--profile`` prints where the service's time goes (cProfile, top 25).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import optuna

from hybridtrain.hpo.controller import Controller
from hybridtrain.hpo.spec import load_spec


def run_service(trials: int, workdir: Path, profile: cProfile.Profile | None = None
                ) -> list[float]:
    """Run one service experiment; returns the completion time of every trial."""
    spec = load_spec({
        "name": "overhead", "objective": {"metric": "loss"},
        "parameters": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
        "algorithm": {"name": "random", "seed": 0},
        "trial": {"command": "echo loss=${x}"}, "max_trials": trials,
        "output_dir": str(workdir / "runs"), "durability": {"poll_interval": 0.002}})
    done: list[float] = []
    controller = Controller(spec, f"sqlite:///{workdir / 'service.db'}",
                            on_event=lambda line: done.append(time.perf_counter())
                            if " complete:" in line else None)
    start = time.perf_counter()
    if profile is not None:
        profile.enable()
    controller.run()
    if profile is not None:
        profile.disable()
    return [start, *done]


def run_baseline(trials: int, workdir: Path) -> list[float]:
    """The bare ask/tell + subprocess loop; returns the completion time of every trial."""
    storage = optuna.storages.RDBStorage(f"sqlite:///{workdir / 'baseline.db'}")
    study = optuna.create_study(storage=storage, sampler=optuna.samplers.RandomSampler(0))
    times = [time.perf_counter()]
    for _ in range(trials):
        trial = study.ask()
        x = trial.suggest_float("x", 0.0, 1.0)
        out = subprocess.run(f"echo loss={x}", shell=True, capture_output=True, text=True,
                             check=True)
        study.tell(trial, float(out.stdout.split("=")[1]))
        times.append(time.perf_counter())
    return times


def per_trial(times: list[float]) -> float:
    """Mean seconds per trial of a list of completion times (the first is the start)."""
    return (times[-1] - times[0]) / (len(times) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200, help="trials per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--flat", type=int, default=0, help="trials of the flatness run")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.2f}, optuna {optuna.__version__}")
    ratios, service_ms, baseline_ms = [], [], []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            s = per_trial(run_service(args.trials, Path(tmp)))
            b = per_trial(run_baseline(args.trials, Path(tmp)))
        ratios.append(s / b)
        service_ms.append(s * 1e3)
        baseline_ms.append(b * 1e3)
    print(f"{args.rounds} rounds of {args.trials} trivial trials, SQLite, parallel_trials=1")
    print(f"  service  {statistics.median(service_ms):.1f} ms/trial (rounds: "
          f"{', '.join(f'{v:.1f}' for v in service_ms)})")
    print(f"  baseline {statistics.median(baseline_ms):.1f} ms/trial (rounds: "
          f"{', '.join(f'{v:.1f}' for v in baseline_ms)})")
    print(f"  ratio service/baseline: median {statistics.median(ratios):.2f}x "
          f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)}; goal <= 1.10x)")
    if args.flat:
        with tempfile.TemporaryDirectory() as tmp:
            times = run_service(args.flat, Path(tmp))
        half = len(times) // 2
        first, second = per_trial(times[:half + 1]), per_trial(times[half:])
        print(f"  flatness, {args.flat} trials: first half {first * 1e3:.1f} ms/trial, second "
              f"half {second * 1e3:.1f} ms/trial (growth {second / first:.2f}x)")
    if args.profile:
        profile = cProfile.Profile()
        with tempfile.TemporaryDirectory() as tmp:
            run_service(args.trials, Path(tmp), profile)
        pstats.Stats(profile).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
