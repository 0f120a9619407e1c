"""HPO service benchmarks; every figure is a ratio against a baseline run in the same process.

(a) overhead: one run of each loop of ``benchmarks/hpo_overhead.py`` (the service on
    trivial trials against a bare Optuna ask/tell + subprocess loop); ms per trial, and
    for the first and the second half of the trials (flat = no growth with the count).
    ``hpo_overhead.py`` alternates several rounds for the figure in docs/results.md.
(b) search quality: best value after N trials of TPE and CMA-ES against random search
    on Branin (2-D) and Hartmann-6 from ``botorch.test_functions``, mean over seeds;
    reported as the ratio of simple regrets (lower is better, < 1 beats random).
(c) early stopping: trials with 20-step learning curves (the Hartmann-6 value approached
    from above with per-step noise); steps spent until the best value of the unpruned run
    is reached, with median and ASHA pruning, as a ratio of the unpruned run's steps.

Usage: ``python benchmarks/hpo.py [--trials 1000] [--quality-trials 60] [--seeds 5]``.
Sampling in (b) and (c) runs in-process: the service uses exactly these samplers and
pruners (built by :mod:`hybridtrain.hpo.algorithms` from a spec), so the process layer
measured in (a) adds nothing to their quality.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import tempfile
from pathlib import Path
from typing import Any

import optuna
import torch
from hpo_overhead import halves_ms, per_trial_ms, run_baseline, run_service  # benchmarks/

from hybridtrain.hpo.algorithms import build_pruner, build_sampler
from hybridtrain.hpo.spec import load_spec

CURVE_STEPS = 20


def _spec(name: str, params: dict[str, Any], algorithm: dict[str, Any],
          early_stopping: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {"name": name, "objective": {"metric": "loss"}, "parameters": params,
            "algorithm": algorithm, "early_stopping": early_stopping or {"name": "none"},
            "trial": {"command": extra.pop("command", "true")}, "max_trials": 1, **extra}


def bench_overhead(trials: int, workdir: Path) -> None:
    """(a): one run of each loop of ``hpo_overhead.py`` (which alternates rounds)."""
    (workdir / "service").mkdir()
    (workdir / "baseline").mkdir()
    service, _ = run_service(trials, workdir / "service")
    baseline, _ = run_baseline(trials, workdir / "baseline")
    s, b = per_trial_ms(service), per_trial_ms(baseline)
    first, second = halves_ms(service)
    print(f"(a) overhead, {trials} trivial trials, SQLite, parallel_trials=1")
    print(f"    service {s:.1f} ms/trial; bare ask/tell+subprocess loop {b:.1f} ms/trial; "
          f"ratio {s / b:.2f}x (rounds and more: benchmarks/hpo_overhead.py)")
    print(f"    service, first half {first:.1f} ms/trial, second half {second:.1f} ms/trial "
          f"(growth {second / first:.2f}x)")


def _objective_fn(name: str) -> tuple[Any, dict[str, Any], float]:
    from botorch.test_functions import Branin, Hartmann

    fn = Branin() if name == "branin" else Hartmann(dim=6)
    params = {f"x{i}": {"type": "float", "low": float(lo), "high": float(hi)}
              for i, (lo, hi) in enumerate(fn.bounds.T.tolist())}
    return fn, params, float(fn.optimal_value)


def _evaluate(fn: Any, trial: optuna.Trial, params: dict[str, Any]) -> float:
    x = torch.tensor([[trial.suggest_float(k, v["low"], v["high"]) for k, v in params.items()]],
                     dtype=torch.float64)
    return float(fn(x).item())


def bench_quality(n_trials: int, seeds: int) -> None:
    print(f"(b) search quality: simple regret after {n_trials} trials, mean of {seeds} seeds "
          "(ratio vs random; < 1 is better)")
    for fname in ("branin", "hartmann6"):
        fn, params, optimum = _objective_fn(fname)
        regrets: dict[str, list[float]] = {}
        for algo in ("random", "tpe", "cmaes"):
            for seed in range(seeds):
                spec = load_spec(_spec(fname, params, {"name": algo, "seed": seed}))
                study = optuna.create_study(sampler=build_sampler(spec))
                study.optimize(lambda t, fn=fn, p=params: _evaluate(fn, t, p), n_trials=n_trials)
                regrets.setdefault(algo, []).append(study.best_value - optimum)
        base = statistics.mean(regrets["random"])
        line = ", ".join(f"{a} {statistics.mean(r):.4f} ({statistics.mean(r) / base:.2f}x)"
                         for a, r in regrets.items())
        print(f"    {fname}: regret {line}")


def _curve_run(fn: Any, params: dict[str, Any], spec: Any, seed: int, target: float | None,
               max_trials: int) -> tuple[float, int]:
    """Run trials with learning curves; returns (best value, steps until target or end)."""
    study = optuna.create_study(sampler=build_sampler(spec), pruner=build_pruner(spec))
    gen = torch.Generator().manual_seed(seed)
    steps = 0
    for _ in range(max_trials):
        trial = study.ask()
        final = _evaluate(fn, trial, params)
        pruned = False
        for step in range(1, CURVE_STEPS + 1):
            steps += 1
            noise = 0.05 * float(torch.randn(1, generator=gen)) / math.sqrt(step)
            value = final + (abs(final) + 1.0) * 2.0 / step + noise
            trial.report(value, step)
            if trial.should_prune():
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                pruned = True
                break
        if not pruned:
            study.tell(trial, value)
        if target is not None and study.best_value <= target:
            break
    return study.best_value, steps


def bench_pruning(n_trials: int, seeds: int) -> None:
    fn, params, _ = _objective_fn("hartmann6")
    print(f"(c) early stopping on Hartmann-6 learning curves ({CURVE_STEPS} steps), TPE, "
          f"{seeds} seeds: steps to reach the unpruned best after {n_trials} trials")
    ratios: dict[str, list[float]] = {"median": [], "asha": []}
    reached: dict[str, int] = {"median": 0, "asha": 0}
    for seed in range(seeds):
        base_spec = load_spec(_spec("p", params, {"name": "tpe", "seed": seed}))
        target, base_steps = _curve_run(fn, params, base_spec, seed, None, n_trials)
        for name, options in (("median", {"n_startup_trials": 5, "n_warmup_steps": 3}),
                              ("asha", {"min_resource": 2, "reduction_factor": 3})):
            spec = load_spec(_spec("p", params, {"name": "tpe", "seed": seed},
                                   {"name": name, **options}))
            best, steps = _curve_run(fn, params, spec, seed, target, 4 * n_trials)
            reached[name] += best <= target
            ratios[name].append(steps / base_steps)
    for name, r in ratios.items():
        print(f"    {name}: {statistics.median(r):.2f}x the steps of no pruning (median over "
              f"seeds; target reached in {reached[name]}/{seeds} seeds)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=1000, help="(a) trivial trials")
    parser.add_argument("--quality-trials", type=int, default=60, help="(b)/(c) trials")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--only", choices=("a", "b", "c"), default=None)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    print(f"machine: {platform.processor() or platform.machine()}, "
          f"{__import__('os').cpu_count()} CPUs, optuna {optuna.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "a"):
            bench_overhead(args.trials, Path(tmp))
    if args.only in (None, "b"):
        bench_quality(args.quality_trials, args.seeds)
    if args.only in (None, "c"):
        bench_pruning(args.quality_trials, args.seeds)


if __name__ == "__main__":
    main()
