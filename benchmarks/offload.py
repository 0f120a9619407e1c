"""Offload benchmark: each mode's throughput (and, with ``--search``, the deepest trainable
model) against plain training through the engine, and the incumbents — FSDP2 with
``CPUOffloadPolicy``, DeepSpeed ZeRO-Offload and ZeRO-3 offload — on the same model, batch
and optimizer (one settings dict in DeepSpeed keys), in the same run, printed as ratios.

    python benchmarks/offload.py                          # small reference GPT, whatever device
    python benchmarks/offload.py --size 6.7b --batch 4 --accumulation 8 --modes plain layer_major \\
        --baselines deepspeed_zero3_offload               # a subset: one call of a few minutes
    python benchmarks/offload.py --size 6.7b --search --search-only --modes plain layer_major

Each configuration runs isolated: a failure (``OOM (device)``, ``host memory: …``,
``failed: …``) is its row and the run goes on; afterwards its memory is released. One whose
host-memory lower bound exceeds 90 % of the available memory is not started (the Linux OOM
killer would end the whole run). Progress goes to stderr; the tables follow, then
``RESULTS {json}`` with every row. On a CPU device the ratios measure bookkeeping only.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import functools
import gc
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # workload.py, peers.py beside this script

from peers import PEERS, peer_config, peer_run  # noqa: E402
from workload import (  # noqa: E402
    GIB,
    OFFLOAD_OPTIMIZER,
    Result,
    Setup,
    bind_host_threads,
    build_model,
    time_steps,
)

import hybridtrain as ht  # noqa: E402
from hybridtrain.models.gpt import GPT, causal_lm_loss, gpt_config, gpt_param_count  # noqa: E402
from hybridtrain.planner.estimate import Estimate, estimate, model_source, resolve_target  # noqa: E402
from hybridtrain.planner.search import MARGIN  # noqa: E402
from hybridtrain.profiling.timeline import measure_timeline, wait_for_host_updates  # noqa: E402
from hybridtrain.runtime.transfer import available_host_bytes  # noqa: E402

MODES: dict[str, dict[str, Any]] = {
    "plain": {},
    "checkpointing": {"activation_checkpointing": {"enabled": True}},
    # Swapping with checkpointing (DeepSpeed's cpu_checkpointing): only block inputs travel;
    # its cost is the swap's, so it is compared with checkpointing (same recomputation).
    "activation_swap": {"activation_checkpointing": {"enabled": True, "cpu_checkpointing": True}},
    # vDNN proper: every saved activation of every block travels (no recomputation).
    "activation_swap_all": {"activation_offload": {"enabled": True}},
    "optimizer_offload": {"zero_optimization": {"stage": 2, "reduce_bucket_size": 20_000_000,
                                                "offload_optimizer": OFFLOAD_OPTIMIZER}},
    "layer_streaming": {"layer_streaming": {"enabled": True, "boundary_activations": "host"}},
    "layer_major": {"layer_streaming": {"enabled": True, "boundary_activations": "host", "layer_major": True}},
    # The planner's 6.7B choice: every block's uploaded weights kept from forward to backward
    # (weights cross once per step) and block inputs kept on the device (recomputed): with
    # clipping, gradients wait on the host (+4 B/param), and 64k tokens of swapped inputs
    # would not fit a 128 GiB host beside them.
    "layer_major_kept": {"layer_streaming": {"enabled": True, "boundary_activations": "recompute",
                                             "layer_major": True, "keep_blocks_for_backward": -1}},
    # The planner's 6.7B choice since issue #39's modes (benchmarks/results/plan-h100-resident-
    # checkpoints-2026-11-28): Twin-Flow's device share on the first blocks (55 % of the
    # update on the device), every 2nd of those blocks checkpointed, block inputs in host memory.
    "twin_flow_first": {"layer_streaming": {"enabled": True, "boundary_activations": "host"},
                        "activation_checkpointing": {"enabled": True, "every_n_blocks": 2},
                        "zero_optimization": {"offload_optimizer": {"ratio": 0.45, "device_share": "first"}}},
}
# Host bytes per parameter an offload cannot do without: the fp32 master and AdamW's two
# moments; FSDP2 and DeepSpeed also keep an fp32 gradient there (ZeRO-3 bf16 weights too).
# Lower bounds: our engine checks its exact need itself (HostMemoryError; +4 B of gradient
# where micro-batches are summed on the host); this only keeps a configuration that cannot
# fit from being built at all.
BASELINES = list(PEERS)
TIMELINE_MODES = {"activation_swap", "activation_swap_all", "optimizer_offload", "layer_streaming", "layer_major",
                  "layer_major_kept", "twin_flow_first"}
"""Our offload and streaming modes: their rows carry a measured ``timeline``."""
HOST_PER_PARAM = {"optimizer_offload": 12, "layer_streaming": 12, "layer_major": 12, "layer_major_kept": 12,
                  "twin_flow_first": 12,
                  "fsdp2_cpu_offload": 16, "deepspeed_zero_offload": 16, "deepspeed_zero3_offload": 18,
                  "deepspeed_super_offload": 18}
# A mode doing the same computation as another but moving data: its cost is shown against it.
SAME_WORK = {"activation_swap": "checkpointing", "activation_swap_all": "plain"}
HOST_MARGIN = 0.9
REFUSED = "host memory: needs >="


@dataclass
class Depth:
    """The deepest ``n_layer`` that trained a step and what stopped the search: ``device OOM``,
    ``host memory``, ``depth limit``, ``failed`` or ``time budget`` (then a lower bound)."""

    name: str
    n_layer: int
    params: int
    limit: str
    detail: str = ""
    lower_bound: bool = False
    predicted_n_layer: int | None = None
    """The planner's largest depth (device and host memory), where the search started."""


def host_bytes(setup: Setup, name: str) -> int:
    """A lower bound of the host memory configuration ``name`` needs: the fp32 model it is
    built from (4 B/param) or the offloaded state (:data:`HOST_PER_PARAM`; all of it when the
    device is the CPU), plus swapped block inputs (fp32 residual stream) of one micro-batch,
    of every micro-batch at once in layer-major order."""
    cfg = setup.model
    per_param = HOST_PER_PARAM.get(name, 16 if setup.device == "cpu" else 4)
    inputs = cfg.n_layer * setup.batch * cfg.seq_len * cfg.d_model * 4
    # Every saved activation: about 34 residual-stream-sized tensors per block (Korthikanti et al.), in bf16.
    swapped = {"activation_swap": inputs, "activation_swap_all": inputs * 34 // 2, "layer_streaming": inputs,
               "layer_major": inputs * setup.accumulation}
    return per_param * gpt_param_count(cfg) + swapped.get(name, 0)


def release_memory(device: str) -> None:
    """Give back what the last configuration held: its cycles (hooks, engines) need a collection;
    torch caches freed device and pinned host blocks where the next configuration cannot use them."""
    gc.collect()
    if device == "cuda" and torch.cuda.is_available():
        with contextlib.suppress(RuntimeError):  # a broken CUDA context fails every later row anyway
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            if hasattr(torch._C, "_host_emptyCache"):
                torch._C._host_emptyCache()
    with contextlib.suppress(OSError, AttributeError):  # glibc: return freed heap pages to the OS
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _rss(key: str, reset: bool = False) -> int:
    """``VmRSS``/``VmHWM`` in bytes (-1 without /proc); ``reset`` first sets VmHWM to the
    current RSS (writing 5 to clear_refs, Linux ≥ 4.0) and gives -1 where that is refused."""
    try:
        if reset:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(key + ":"))
    except (OSError, StopIteration):
        return -1


def _why(exc: Exception) -> str:
    """A failure as a row's status."""
    first = (str(exc).strip().splitlines() or [""])[0][:160]
    if isinstance(exc, torch.OutOfMemoryError) or "CUDA out of memory" in first or "ALLOC_FAILED" in first:
        return "OOM (device)"
    if isinstance(exc, MemoryError) or "can't allocate memory" in first:  # HostMemoryError included
        return f"host memory: {first or type(exc).__name__}"
    return f"failed: {type(exc).__name__}: {first}"


def run_isolated(name: str, setup: Setup, run: Callable[[], Result], needs_host: int) -> Result:
    """``run()`` isolated: refused if its host lower bound does not fit, a failure turned into its
    status, peaks filled in, memory released. Nothing ``run`` built may be reachable from the Result."""
    have = available_host_bytes()
    if needs_host > HOST_MARGIN * have:
        return Result(name, f"{REFUSED} {needs_host / GIB:.1f} GiB (estimate); limit {HOST_MARGIN:.0%} of "
                            f"{have / GIB:.1f} GiB available", params=gpt_param_count(setup.model))
    if setup.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rss = _rss("VmRSS", reset=True)
    try:
        result = run()
        cuda = setup.device == "cuda"
        peak = torch.cuda.max_memory_allocated() / GIB if cuda else math.nan
        reserved = torch.cuda.max_memory_reserved() / GIB if cuda else math.nan
        result = replace(result, peak_gib=peak, reserved_gib=reserved,
                         host_gib=(_rss("VmHWM") - rss) / GIB if rss >= 0 else math.nan)
    except Exception as exc:  # torch.OutOfMemoryError, HostMemoryError, an op that failed to build, …
        result = Result(name, _why(exc), params=gpt_param_count(setup.model))
        # The exception can outlive this block (layer-major streaming keeps a failed worker's),
        # and its traceback's frames reach the engine through a cycle gc cannot collect.
        error: BaseException | None = exc
        while error is not None and error.__traceback__ is not None:
            error.__traceback__, error = None, error.__cause__ or error.__context__
    # Here, outside the except block, the traceback and the frames holding the engine are gone.
    release_memory(setup.device)
    return result


def measure(setup: Setup, name: str) -> Result:
    """Our engine in mode ``name``; the engine lives in this frame only. ``model.blocks``
    is named because a 1-layer model has no repetition to find its blocks by."""
    try:  # the planner's figures are a comparison: their failure must not cost the measurement
        planned = planned_step(setup, name)
        peak, step_s = planned.device_peak_bytes / GIB, planned.step_seconds
    except Exception as exc:  # noqa: BLE001 - reported, and the row goes on without them
        print(f"[offload] {name}: no planner estimate ({_why(exc)})", file=sys.stderr, flush=True)
        peak, step_s = math.nan, math.nan
    engine = ht.initialize(build_model(setup.model), engine_config(setup, name), loss_fn=causal_lm_loss)
    engine.overlap_updates = setup.overlap
    data = setup.data()
    result = time_steps(setup, name, lambda: engine.train_batch(data), functools.partial(wait_for_host_updates, engine),
                        config=engine_config(setup, name))
    moved = dict(engine.last_timings.transfer_bytes)  # the last timed step's
    # One further step, after the timed ones (its recorders must not touch their figures).
    timeline = measure_timeline(engine, data) if name in TIMELINE_MODES and setup.steps else None
    return replace(result, transfer_bytes=moved, planned_peak_gib=peak, planned_step_s=step_s, timeline=timeline)


def engine_config(setup: Setup, name: str) -> dict[str, Any]:
    """Our engine's configuration for mode ``name``."""
    return {"device": setup.device, "model": {"blocks": "blocks"}, **setup.settings(**copy.deepcopy(MODES[name]))}


def planned_step(setup: Setup, name: str) -> Estimate:
    """The planner's estimate of mode ``name`` on this machine, from a meta copy of the model
    (nothing allocated): what ``hybridtrain estimate`` would tell a user before the run."""
    with torch.device("meta"):
        model = GPT(setup.model)
    example = tuple(t[: setup.batch].to("meta") for t in setup.example())
    target = resolve_target() if setup.device == "cuda" else None
    return estimate(engine_config(setup, name), target, model=model_source(model, example, causal_lm_loss))


def predicted_depth(setup: Setup, name: str, limit: int) -> int:
    """The planner's largest ``n_layer`` for mode ``name``: its device peak and host bytes at
    1 and 2 layers, extended linearly to this device's memory (less the planner's margin) and
    to :data:`HOST_MARGIN` of the available host memory less the fp32 model the benchmark
    builds it from."""
    one, two = (planned_step(setup.depth(n), name) for n in (1, 2))
    params_one, params_two = (gpt_param_count(setup.depth(n).model) for n in (1, 2))
    device = (torch.cuda.mem_get_info()[1] if setup.device == "cuda" else available_host_bytes()) * (1 - MARGIN)
    host = HOST_MARGIN * available_host_bytes()
    fits = [limit]
    for have, at_one, at_two, model_bytes in (
            (device, one.device_peak_bytes, two.device_peak_bytes, (0, 0)),
            (host, one.host_bytes, two.host_bytes, (4 * params_one, 4 * params_two))):
        per_layer = at_two + model_bytes[1] - at_one - model_bytes[0]
        if per_layer > 0:
            fits.append(1 + int((have - at_one - model_bytes[0]) // per_layer))
    return max(1, min(fits))


def largest_depth(setup: Setup, name: str, limit: int = 512, budget_s: float = math.inf,
                  start: int | None = None, tolerance: float = 0.0) -> Depth:
    """Largest ``n_layer`` of the model's width that trains one step in mode ``name``: from
    ``start`` (the planner's guess) up by 1.25x or down by 1/1.25 until it brackets the
    limit, without ``start`` doubling from 1, then bisection until the bracket is within
    ``tolerance`` of the deepest that trained (0: exact). A depth whose host lower bound does
    not fit is not built. It stops before a probe predicted (from the last two probes' times)
    to end past ``budget_s``, answering the deepest depth so far as a lower bound."""
    deadline = time.perf_counter() + budget_s
    grow = 2.0 if start is None else 1.25
    low, high, failed = 0, limit + 1, False  # low trains (0 trivially), high does not
    why, detail, lower_bound = "depth limit", f"n_layer <= {limit}", False
    timed: list[tuple[int, float]] = []
    n = min(max(start or 1, 1), limit)
    while high - low > max(1, int(tolerance * low)):
        (n0, t0), (n1, t1) = timed[-2] if len(timed) > 1 else (0, 0.0), timed[-1] if timed else (1, 0.0)
        if time.perf_counter() + max(t1 + (t1 - t0) / max(n1 - n0, 1) * (n - n1), 0.0) >= deadline:
            why, detail, lower_bound = "time budget", f"{budget_s:.0f} s spent", True
            break
        probe, begun = setup.depth(n, steps=0), time.perf_counter()
        result = run_isolated(name, probe, functools.partial(measure, probe, name), host_bytes(probe, name))
        if not result.status.startswith(REFUSED):  # a refused depth took no time
            timed.append((n, time.perf_counter() - begun))
        if result.ok:
            low = n
        else:
            high, failed, detail = n, True, result.status
            why = ("device OOM" if result.status == "OOM (device)" else
                   "host memory" if result.status.startswith("host memory") else "failed")
        if not failed:
            n = min(max(math.ceil(low * grow), low + 1), high - 1)
        elif low == 0 and start is not None:
            n = max(1, min(high - 1, int(high / grow)))
        else:
            n = (low + high) // 2
    if not lower_bound and high - low > 1:
        detail += f"; stopped within {tolerance:.0%}"
    return Depth(name, low, gpt_param_count(setup.depth(low).model) if low else 0, why, detail, lower_bound, start)


def _emit(path: str | None, common: dict[str, Any], row: dict[str, Any]) -> None:
    """Append ``common | row`` to ``path`` as one strict-JSON line (NaN → null), at once."""
    if path is None:
        return
    line = json.dumps(json.loads(json.dumps({**common, **row}), parse_constant=lambda _: None), allow_nan=False)
    with open(path, "a") as fh:
        fh.write(line + "\n")


def _told(run: Callable[[], Result]) -> Result:
    """``run()``, told on stderr at once: a call cut off by its time limit still shows results."""
    start = time.perf_counter()
    r = run()
    done = f"{r.tokens_s:.0f} tokens/s" if r.ok else r.status
    print(f"[offload] {r.name}: {done} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    return r


def _row(r: Result, ratio: str = "") -> str:
    if not r.ok:
        return f"{r.name:24s} {r.status}" + (f": {r.reason}" if r.reason else "")
    mfu, peak, host = (f"{v:{f}}" if math.isfinite(v) else "-" for v, f in
                       ((r.mfu, ".1%"), (r.peak_gib, ".2f"), (r.host_gib, ".2f")))  # "-": not measurable here
    return (f"{r.name:24s} {r.step_s:8.3f} {r.tokens_s:10.0f} {r.tflops:8.3f} {mfu:>6s} {peak:>8s} {host:>8s} "
            f"{ratio}").rstrip()


def report(modes: list[Result], baselines: list[Result], depths: list[Depth]) -> None:
    """Modes (ratio to plain, else to layer_major), incumbents (our peer's ratio to them), depths."""
    ok = {r.name: r for r in modes if r.ok}
    ref = next((ok[n] for n in ("plain", "layer_major") if n in ok), None)
    against = ("ratio: no reference ran" if ref is None else "ratio to plain" if ref.name == "plain"
               else "ratio to layer_major (plain did not run)")
    if modes or baselines:
        print(f"{'configuration':24s} {'step s':>8s} {'tokens/s':>10s} {'TFLOP/s':>8s} {'MFU':>6s} "
              f"{'peak GiB':>8s} {'host GiB':>8s} {against if modes else ''}".rstrip())
    for r in modes:
        ratio = f"{r.tokens_s / ref.tokens_s:.2f}x {ref.name}" if ref else ""
        same = ok.get(SAME_WORK.get(r.name, ""))
        if r.ok and same is not None and same is not ref:
            ratio += f", {r.tokens_s / same.tokens_s:.2f}x {same.name}"
        print(_row(r, ratio))
    for r in baselines:
        peer = PEERS[r.name]
        ours = next((m for m in modes if m.name == peer), None)
        print(_row(r, f"ours ({peer}) {ours.tokens_s / r.tokens_s:.2f}x it" if ours and ours.ok
                   else f"ours ({peer}): {ours.status if ours else 'not measured'}"))
    planned = [r for r in modes if r.ok and math.isfinite(r.planned_step_s)]
    if planned:
        print(f"{'planner vs measured':30s} {'peak GiB':>17s} {'measured/planned':>16s} {'step s':>15s} "
              f"{'measured/planned':>16s}")
    for r in planned:
        print(f"{'planner: ' + r.name:30s} {r.peak_gib:8.2f}/{r.planned_peak_gib:<8.2f} "
              f"{r.peak_gib / r.planned_peak_gib:16.2f} {r.step_s:7.3f}/{r.planned_step_s:<7.3f} "
              f"{r.step_s / r.planned_step_s:16.2f}")
    plain = next((d for d in depths if d.name == "plain" and d.params), None)
    for d in depths:
        ratio = f"{d.params / plain.params:5.2f}x plain" if plain else ""
        guess = f" (planner: {d.predicted_n_layer})" if d.predicted_n_layer else ""
        print(f"largest {d.name:18s} n_layer {'>=' if d.lower_bound else '  '}{d.n_layer:4d}{guess} "
              f"{d.params / 1e9:7.3f}B params {ratio} limit: {d.limit} ({d.detail})")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure the chosen modes, incumbents and depths; print the tables and ``RESULTS``."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size", default="mini")
    parser.add_argument("--n-layer", type=int, default=None, help="override the size's depth")
    parser.add_argument("--seq-len", type=int, default=None, help="override the size's sequence length")
    parser.add_argument("--batch", type=int, default=4, help="micro-batch size")
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after the warm-up steps)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before the timed ones")
    parser.add_argument("--peer-checkpointing", action="store_true",
                        help="the peers checkpoint every block (where their one big micro-batch's activations "
                             "would not fit the device otherwise)")
    parser.add_argument("--bind-cores", action="store_true",
                        help="bind this process to the physical cores, one thread each (DeepSpeed's "
                             "--bind_cores_to_rank for one rank), for every configuration alike")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    parser.add_argument("--baselines", nargs="*", default=BASELINES, choices=BASELINES)
    parser.add_argument("--no-baselines", action="store_true", help="skip FSDP2 and DeepSpeed")
    parser.add_argument("--search", action="store_true", help="largest depth per mode (meant for CUDA)")
    parser.add_argument("--search-only", action="store_true", help="no throughput rows, no baselines")
    parser.add_argument("--search-budget-s", type=float, default=480.0, help="time for the whole search")
    parser.add_argument("--search-max-layers", type=int, default=512)
    parser.add_argument("--search-tolerance", type=float, default=0.0,
                        help="stop when the bracket is within this fraction of the deepest depth that trained")
    parser.add_argument("--search-from-plan", action="store_true",
                        help="start each search at the planner's largest depth instead of doubling from 1")
    parser.add_argument("--search-start", type=int, default=None,
                        help="start each search at this depth (a depth already known to train, say)")
    parser.add_argument("--clip", type=float, default=0.0,
                        help="gradient clipping for every configuration (0 = none); the host step then waits "
                             "for every gradient")
    parser.add_argument("--no-overlap", action="store_true",
                        help="our engine without overlap_updates (a deferred host step finishes before the next "
                             "forward)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="device bf16 peak (H100 SXM: 989)")
    parser.add_argument("--jsonl", default=None, help="append each row to this file as soon as it is measured "
                                                      "(a run cut off by its time limit keeps what it measured)")
    parser.add_argument("--part", default="offload", help="the rows' part field in --jsonl")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in (("n_layer", args.n_layer), ("seq_len", args.seq_len)) if v is not None}
    bound = bind_host_threads() if args.bind_cores else None
    setup = Setup(gpt_config(args.size, **overrides), args.batch, args.accumulation, args.steps, args.device,
                  args.peak_tflops, args.clip, not args.no_overlap, args.warmup, args.peer_checkpointing)
    cfg = setup.model
    print(f"device={args.device} torch={torch.__version__} threads={torch.get_num_threads()} size=gpt-{args.size} "
          f"n_layer={cfg.n_layer} d_model={cfg.d_model} seq_len={cfg.seq_len} micro_batch={args.batch} "
          f"accumulation={args.accumulation} params={gpt_param_count(cfg):,} "
          f"host_available={available_host_bytes() / GIB:.1f}GiB", flush=True)
    print(f"TFLOP/s, MFU: model FLOPs 6·N + 12·n_layer·seq_len·d_model per token (PaLM; recomputation not "
          f"counted) against {args.peak_tflops:g} TFLOP/s; peak GiB: device max allocated; host GiB: RSS growth")
    modes: list[Result] = []
    baselines: list[Result] = []
    depths: list[Depth] = []
    emit = functools.partial(_emit, args.jsonl, {"part": args.part, "size": args.size, "n_layer": cfg.n_layer,
                                                 "tokens_per_step": args.batch * args.accumulation * cfg.seq_len,
                                                 "device": args.device, "clip": args.clip,
                                                 "overlap": not args.no_overlap, "bind": bound})
    if not args.search_only:
        # The process's first run pays one-off costs (CUDA context, kernels, allocator, thread
        # pools) that would land on whichever configuration came first: a 1-layer plain step.
        warm = setup.depth(1, steps=0)
        run_isolated("warm-up", warm, functools.partial(measure, warm, "plain"), host_bytes(warm, "plain"))
        for name in args.modes:
            modes.append(_told(functools.partial(run_isolated, name, setup, functools.partial(measure, setup, name),
                                                 host_bytes(setup, name))))
            emit({"kind": "mode", **asdict(modes[-1])})
    if args.search:  # before DeepSpeed, whose global state must not touch our probes
        deadline = time.perf_counter() + args.search_budget_s
        for index, name in enumerate(args.modes):  # each mode gets an equal share of what is left
            share = max(deadline - time.perf_counter(), 0.0) / (len(args.modes) - index)
            start = args.search_start
            if args.search_from_plan and start is None:
                try:
                    start = predicted_depth(setup, name, args.search_max_layers)
                except Exception as exc:  # noqa: BLE001 - the search then doubles from 1
                    print(f"[offload] {name}: no planner depth ({_why(exc)})", file=sys.stderr, flush=True)
            depths.append(largest_depth(setup, name, args.search_max_layers, share, start, args.search_tolerance))
            emit({"kind": "depth", **asdict(depths[-1])})
    for name in [] if args.no_baselines or args.search_only else args.baselines:
        run = peer_run(setup, name)
        baselines.append(Result(name, "skipped", reason=run, params=gpt_param_count(cfg),
                                config=peer_config(setup, name)) if isinstance(run, str) else
                         _told(functools.partial(run_isolated, name, setup, run, host_bytes(setup, name))))
        emit({"kind": "baseline", "peer": PEERS[name], **asdict(baselines[-1])})
    report(modes, baselines, depths)
    summary = {"setup": {"size": args.size, **asdict(cfg), "micro_batch": args.batch, "accumulation": args.accumulation,
                         "steps": args.steps, "device": args.device, "torch": torch.__version__},
               "rows": [{"kind": "mode", **asdict(r)} for r in modes]
               + [{"kind": "baseline", "peer": PEERS[r.name], **asdict(r)} for r in baselines],
               "search": [asdict(d) for d in depths]}
    summary = json.loads(json.dumps(summary), parse_constant=lambda _: None)  # strict JSON: NaN → null
    print("RESULTS " + json.dumps(summary, allow_nan=False), flush=True)
    return summary


if __name__ == "__main__":
    main()
