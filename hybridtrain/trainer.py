"""The training loop behind ``hybridtrain train``: build model and data from the config,
run the engine, print and log metrics, checkpoint periodically, resume exactly.

Checkpoints are ``<output_dir>/checkpoints/step-NNNNNNN`` directories; each appears by an
atomic rename, so the newest one present is complete. SIGTERM or Ctrl-C finishes the
current step, saves a checkpoint and exits, so a preempted run loses nothing
(:mod:`hybridtrain.stopping`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hybridtrain import checkpoint as ckpt
from hybridtrain.compose import check_autocast_math
from hybridtrain.config import Config
from hybridtrain.data import TokenBatches
from hybridtrain.engine import Engine
from hybridtrain.errors import peer_failure
from hybridtrain.metrics import METRICS_ENV, MetricsLog
from hybridtrain.models.gpt import causal_lm_loss
from hybridtrain.monitoring.monitors import Outcome
from hybridtrain.monitoring.readings import device_peak_tflops, flops_per_token, memory_readings
from hybridtrain.monitoring.telemetry import Telemetry, check_monitoring
from hybridtrain.outputs import check_metrics_file
from hybridtrain.parallel.mesh import (
    end_process_group,
    env_world_size,
    restart_count,
)
from hybridtrain.plan.checks import parallel_sizes
from hybridtrain.prepare import Prepared, prepare
from hybridtrain.profiling.scheduled import ScheduledProfile
from hybridtrain.recovery.memory_plans import check_limit_reachable, planner_fallback
from hybridtrain.recovery.oom import MemoryGuard
from hybridtrain.run_dir import (
    Start,
    clear_run,
    decide_start,
    newest_checkpoint_dir,
    previous_global_batch,
    record_global_batch,
    remove_trash,
)
from hybridtrain.run_lock import own_run_dir
from hybridtrain.runtime.device import peak_memory_bytes, reset_peak_memory
from hybridtrain.stopping import StopRequest, on_any_rank
from hybridtrain.training_inputs import data_and_model, example_batch

CHECKPOINTS = "checkpoints"
logger = logging.getLogger(__name__)
Road = Callable[..., Prepared]
"""What builds a run's engine: :func:`hybridtrain.prepare.prepare`'s arguments
``(cfg, model, loss_fn, optimizer, example_batch)`` and result."""


@dataclass
class TrainSummary:
    """What a run did; also written to ``<output_dir>/summary.json``.

    ``peak_memory_bytes`` is the CUDA allocator's peak of allocated bytes, or on CPU the
    process's peak resident set size (everything it touched: Python, torch's libraries,
    the data set). A CPU ``device_memory_limit`` is checked against live tensor bytes
    instead: their peak is ``peak_tensor_bytes`` (None without such a limit).
    """

    steps: int
    start_step: int
    first_loss: float | None
    last_loss: float | None
    eval_loss: float | None
    tokens_per_s: float
    peak_memory_bytes: int
    skipped_steps: int
    interrupted: bool
    checkpoints: list[str] = field(default_factory=list)
    device: str = "cpu"
    device_memory_limit: int | None = None
    peak_tensor_bytes: int | None = None


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``output_dir`` (commit marker present, every
    file there with its size: :func:`hybridtrain.checkpoint.latest_complete`), if any."""
    return ckpt.latest_complete(Path(output_dir) / CHECKPOINTS)


def run_training(cfg: Config, resume: bool | str = False, progress: bool = True,
                 overwrite: bool = False, road: Road | None = None) -> TrainSummary:
    """Train as ``cfg`` says, as the one owner of ``train.output_dir``
    (:mod:`hybridtrain.run_lock`; another live run there is one line, before anything
    is read or built); arguments and errors as :func:`_run_training`.

    Raises:
        RunDirBusyError: another live run owns ``train.output_dir`` (a ``ValueError``).
    """
    with own_run_dir(Path(cfg.train.output_dir), int(os.environ.get("RANK", "0")), restart_count()):
        return _run_training(cfg, resume, progress, overwrite, road)


def _run_training(cfg: Config, resume: bool | str = False, progress: bool = True,
                  overwrite: bool = False, road: Road | None = None) -> TrainSummary:
    """Train as ``cfg`` says; see the module docstring.

    Args:
        cfg: validated configuration.
        resume: ``True`` = continue from the newest checkpoint in ``train.output_dir`` (fresh
            start when there is none); a path = continue from that checkpoint. After a
            torchrun restart every rank resumes from the newest checkpoint without it.
        progress: show a progress bar on a terminal.
        overwrite: remove an earlier run's checkpoints and metrics from ``train.output_dir``
            first (:func:`hybridtrain.run_dir.clear_run`).
        road: what builds the engine in place of :func:`hybridtrain.prepare.prepare`, from a layer
            above (``hybridtrain train`` gives the DeepSpeed drop-in's for ``precision_math:
            deepspeed``, :func:`hybridtrain.deepspeed.building.prepare_with_deepspeed_math`).

    Raises:
        ValueError: a fresh start into an output directory that has checkpoints, and every
            configuration error, before anything is built.
    """
    out = Path(cfg.train.output_dir)
    start_as = check_output_dir(cfg, resume, overwrite)
    if start_as.mode == "resume":
        cfg = _same_global_batch(cfg, previous_global_batch(out))
    if road is None:  # the one road builds autocast only
        check_autocast_math(cfg, "hybridtrain train")
    check_monitoring(cfg)
    check_limit_reachable(cfg)  # a device_memory_limit no plan fits under: one line, nothing allocated
    telemetry = Telemetry(cfg)
    summary: TrainSummary | None = None
    try:
        # /metrics answers from here on, while the model is still being built.
        telemetry.start_server()
        data, model = data_and_model(cfg, fits_host=True)
        rates = _Rates(flops_per_token(model), cfg.train.peak_tflops)
        example = example_batch(cfg, data)
        # The one road ("auto": the planner), or the caller's above it.
        prepared = (road or prepare)(cfg, model, causal_lm_loss, None, example)
        engine, plan, cfg = prepared.engine, prepared.plan, prepared.plan.config
        rates.peak_tflops = device_peak_tflops(engine.device, cfg.train.peak_tflops)
        rates.world_size = engine.topology.world_size
        # With several processes every rank trains, but only rank 0 writes files and prints.
        metrics = MetricsLog(out / "metrics.jsonl") if engine.parallel.is_writer else None
        if metrics is not None and start_as.mode == "overwrite":
            clear_run(out)
        if metrics is not None:
            remove_trash(out)
        start, restarts = _resume(engine, out, (start_as.checkpoint or True) if start_as.mode == "resume" else False,
                                  metrics)
        if metrics is not None:
            if start == 0:  # records of a round that died before its first checkpoint
                metrics.truncate_after(0)
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text(cfg.model_dump_json(indent=1))
            record_global_batch(out, engine.options.batch.global_batch)
        telemetry.open_monitors(engine.parallel.is_writer, engine.options.batch.global_batch, start,
                                cfg.model_dump())
        telemetry.started(start, restarts)
        if start >= cfg.train.steps and engine.parallel.is_writer:
            print(f"resume: the run is already at step {start} of train.steps = {cfg.train.steps}; nothing to "
                  "train (raise --steps to continue it)", file=sys.stderr)
        try:
            summary = _loop(engine, cfg, data, metrics, start, progress, telemetry, rates, restarts)
        except RuntimeError as exc:  # a dead or stuck peer: one line naming it, not gloo's words
            failure = peer_failure(exc, cfg.distributed.timeout_s)
            if failure is None:
                raise
            raise failure from exc
        if plan.sizes.world > 1:
            end_process_group()
    finally:
        outcome: Outcome = "failed" if summary is None else "interrupted" if summary.interrupted else "finished"
        telemetry.close(cfg.train.metrics_linger_s if outcome == "finished" else 0.0, outcome)
    return summary


def check_output_dir(cfg: Config, resume: bool | str = False, overwrite: bool = False) -> Start:
    """How a start treats ``train.output_dir`` (:func:`hybridtrain.run_dir.decide_start`),
    decided from the files alone, so a launcher can refuse before starting any rank.

    Raises:
        ValueError: see :func:`hybridtrain.run_dir.decide_start`.
    """
    out = Path(cfg.train.output_dir)
    if os.environ.get(METRICS_ENV):  # never truncate another run's records
        check_metrics_file(os.environ[METRICS_ENV], out / "metrics.jsonl")
    return decide_start(out, latest_checkpoint(out), resume, overwrite, restart_count(),
                        newest_checkpoint_dir(out / CHECKPOINTS))


def _same_global_batch(cfg: Config, previous: int | None) -> Config:
    """``cfg`` with the run's global batch kept on a resume, whatever the world size now: a
    run restarted on fewer processes (an elastic ``--nnodes MIN:MAX`` scale-down) raises
    gradient accumulation instead of changing the math. A ``train_batch_size`` in ``cfg``
    wins over the run's; with no micro-batch size, the micro-batch is what changes."""
    total = cfg.train_batch_size or previous
    micro = cfg.train_micro_batch_size_per_gpu
    if total is None or cfg.pipeline.micro_batches is not None:
        return cfg
    try:
        dp = parallel_sizes(cfg, env_world_size())[0]
    except ValueError:
        return cfg  # the plan says what is wrong with the sizes
    accumulation = total // (micro * dp) if micro and total % (micro * dp) == 0 else None
    if micro is None or accumulation is None:
        return cfg.model_copy(update={"train_batch_size": total})
    if (cfg.train_batch_size, cfg.gradient_accumulation_steps) != (total, accumulation):
        logger.info("%d data-parallel replicas: gradient_accumulation_steps %s → %d keeps the run's "
                    "train_batch_size = %d", dp, cfg.gradient_accumulation_steps, accumulation, total)
    return cfg.model_copy(update={"train_batch_size": total, "gradient_accumulation_steps": accumulation})


def _resume(engine: Engine, out: Path, resume: bool | str, metrics: MetricsLog | None) -> tuple[int, int]:
    """The step to continue after, and how many times this run has been resumed so far.

    Saves an earlier round left unfinished are removed first; a newest checkpoint that is
    incomplete or corrupt is passed over for the previous complete one, in one line."""
    if engine.parallel.is_writer:
        ckpt.remove_partial(out / CHECKPOINTS)
    if not resume:
        return 0, 0
    if isinstance(resume, str):
        path, client = Path(resume), engine.load_checkpoint(resume)
    else:
        say = (lambda line: print(line, file=sys.stderr)) if engine.parallel.is_writer else (lambda line: None)
        found = ckpt.resume_newest(out / CHECKPOINTS, engine.load_checkpoint, say, refuse=True)
        if found is None:
            say(f"resume: no checkpoint in {out / CHECKPOINTS}; starting at step 0")
            return 0, 0
        path, client = found
    step = int(client["data_step"])
    if metrics is not None:
        metrics.truncate_after(step)
    if engine.parallel.is_writer:  # one line for the run, not one per rank
        print(f"resume: continuing from {path} at step {step}", file=sys.stderr)
    return step, int(client.get("restarts", 0)) + 1


@dataclass
class _Rates:
    """What turns a step's tokens/s into TFLOP/s and MFU."""

    flops_per_token: float
    peak_tflops: float | None = None
    world_size: int = 1

    def of(self, tokens_per_s: float) -> dict[str, float]:
        tflops = self.flops_per_token * tokens_per_s / 1e12
        if not self.peak_tflops:
            return {"tflops": tflops}
        return {"tflops": tflops, "mfu": tflops / (self.peak_tflops * self.world_size)}


def _loop(engine: Engine, cfg: Config, data: TokenBatches, metrics: MetricsLog | None, start: int,
          progress: bool, telemetry: Telemetry, rates: _Rates, restarts: int) -> TrainSummary:
    # Every rank draws the same global batch and trains its data-parallel shard of it.
    global_batch = engine.options.batch.global_batch
    tokens_per_step = global_batch * cfg.data.seq_len
    writer = metrics is not None
    reset_peak_memory(engine.device)
    bar = tqdm(total=cfg.train.steps, initial=start, file=sys.stderr, dynamic_ncols=True,
               disable=not (writer and progress and sys.stderr.isatty()), unit="step")
    postfix: dict[str, str] = {}  # the last step's loss, tokens/s and memory
    micro = None if bar.disable or engine.options.batch.accumulation_steps == 1 else _micro_progress(bar, postfix)
    first: float | None = None
    last: float | None = None
    eval_loss: float | None = None
    saved: list[str] = []
    elapsed, step, stopping = 0.0, start, False
    tensor_peak: int | None = None  # live tensor bytes, on CPU under device_memory_limit
    # The guard enforces device_memory_limit and, with oom_recovery, may switch to another
    # plan's engine (the planner's choice; the model rebuilt from the config) to rerun a step
    # that ran out of memory.
    profiler = ScheduledProfile(cfg, writer)  # DeepSpeed's flops_profiler at its profile_step
    with StopRequest() as stop, MemoryGuard(engine, cfg, lambda c: data_and_model(c)[1],
                                             untracked=(data.train_tokens, data.val_tokens),
                                             replan=planner_fallback) as guard:
        for step in range(start + 1, cfg.train.steps + 1):
            engine.micro_batch_done = micro  # each step's engine: out-of-memory recovery may switch it
            # This loop reads the parameters only through the engine (which waits for them).
            engine.overlap_updates = True
            t0 = time.perf_counter()
            batch = engine.local_batch(data.train_batch(step - 1, global_batch))
            t_data = time.perf_counter() - t0
            last = profiler.train_batch(engine, batch, guard.train_batch)
            engine = guard.engine
            if guard.live is not None:  # the count the limit is checked against, its peak in this step
                tensor_peak = max(tensor_peak or 0, guard.live.peak_bytes)
            dt = time.perf_counter() - t0
            elapsed += dt
            first = last if first is None else first
            record = _step_record(engine, step, last, tokens_per_step / dt)
            record.update(rates.of(record["tokens_per_s"]), samples_per_s=global_batch / dt,
                          step_time_s=dt, data_s=t_data)
            if restarts:
                record["restarts"] = restarts
            if metrics is not None:
                metrics.write(record)
            telemetry.publish(record)
            postfix.update(loss=f"{last:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                           mem=f"{record['peak_memory_bytes'] / 2**30:.2f}GiB")
            bar.set_postfix(postfix, refresh=False)
            bar.update(1)
            if writer and (step % cfg.steps_per_print == 0 or step == cfg.train.steps):
                print(" ".join(f"{k}={_fmt(v)}" for k, v in record.items() if k not in _NOT_PRINTED), flush=True)
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 or step == cfg.train.steps:
                eval_loss = _evaluate(engine, data, cfg.train.eval_batches, global_batch)
                if metrics is not None:
                    metrics.write({"step": step, "eval_loss": eval_loss})
                    print(f"step={step} eval_loss={eval_loss:.6g}", flush=True)
                telemetry.publish({"step": step, "eval_loss": eval_loss})
            boundary = cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0
            # Ranks see a signal at different moments: they agree after every step, so all
            # of them save the same step (a rank saving alone would wait for the others).
            stopping = on_any_rank(stop.should_stop(), engine.device)
            if boundary or step == cfg.train.steps or stopping:
                t_save = time.perf_counter()
                try:
                    path = _save(engine, Path(cfg.train.output_dir), step, cfg.train.keep_checkpoints, restarts,
                                 cfg.train.checkpoint_async, start, saved)
                except (RuntimeError, OSError) as exc:  # CheckpointError is a RuntimeError
                    raise _disk_full(exc, engine, Path(cfg.train.output_dir), step) from exc
                saved.append(str(path))
                if writer:
                    # A background save is timed until it returned; its size is known once committed.
                    done_save = {"step": step, "checkpoint_s": time.perf_counter() - t_save}
                    if not cfg.train.checkpoint_async:
                        done_save["checkpoint_bytes"] = _dir_bytes(path)
                    if metrics is not None:
                        metrics.write(done_save)
                    telemetry.publish(done_save)
            if stopping:
                break
        bar.close()
        interrupted = stopping and step < cfg.train.steps
    try:
        ckpt.wait_for_pending()  # the last background save is committed (or its failure said) before the end
    except (RuntimeError, OSError) as exc:
        raise _disk_full(exc, engine, Path(cfg.train.output_dir), step) from exc
    done = step - start
    if done == 0:
        # Nothing left to train (a --resume of a finished run): the run's summary stays as its
        # training wrote it, instead of one with no losses and 0 tokens/s.
        earlier = _read_summary(Path(cfg.train.output_dir))
        if earlier is not None:
            return earlier
    summary = TrainSummary(
        steps=step, start_step=start, first_loss=first, last_loss=last, eval_loss=eval_loss,
        tokens_per_s=tokens_per_step * done / elapsed if elapsed else 0.0,
        peak_memory_bytes=peak_memory_bytes(engine.device), skipped_steps=engine.skipped_steps,
        # keep_checkpoints may have pruned earlier saves of this run: only those on disk are listed.
        interrupted=interrupted, checkpoints=[p for p in saved if Path(p).is_dir()], device=str(engine.device),
        device_memory_limit=cfg.device_memory_limit, peak_tensor_bytes=tensor_peak,
    )
    if writer and done > 0:
        Path(cfg.train.output_dir, "summary.json").write_text(json.dumps(summary.__dict__, indent=1))
    return summary


def _read_summary(out: Path) -> TrainSummary | None:
    """The run's ``summary.json``, if one is there and reads as a summary."""
    try:
        return TrainSummary(**json.loads((out / "summary.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _micro_progress(bar: tqdm, postfix: dict[str, str]) -> Callable[[int, int], None]:
    """Shows a step's micro-batches in the bar (``micro=37/512``), at most twice a second:
    a step of hundreds of them would otherwise show nothing for minutes."""
    shown = 0.0

    def show(done: int, of: int) -> None:
        nonlocal shown
        if time.monotonic() - shown >= 0.5:
            shown = time.monotonic()
            bar.set_postfix(postfix, micro=f"{done}/{of}")

    return show


_NOT_PRINTED = frozenset({"samples_per_s", "step_time_s", "data_s", "memory_allocated_bytes",
                          "memory_reserved_bytes", "alloc_retries", "ooms", "pinned_host_bytes", "restarts",
                          "transfer_bytes", "peak_memory_reserved_bytes"})
"""Record fields left out of the printed ``step=…`` line (they stay in metrics.jsonl)."""


def _step_record(engine: Engine, step: int, loss: float, tokens_per_s: float) -> dict[str, Any]:
    record: dict[str, Any] = {"step": step, "loss": loss, "lr": engine.get_lr()[0],
                              "tokens_per_s": tokens_per_s}
    # Memory figures of this rank (peak_memory_bytes as before; CUDA adds allocated,
    # reserved, allocator retries, OOMs and pinned host memory), read without a sync.
    memory = memory_readings(engine.device)
    record["peak_memory_bytes"] = memory.pop("peak_memory_bytes")
    record.update(memory)
    record["transfer_bytes"] = dict(engine.last_timings.transfer_bytes)
    if engine.scaler is not None:
        record["loss_scale"] = engine.loss_scale
    if engine.skipped_steps:
        record["skipped_steps"] = engine.skipped_steps
    if engine.options.wall_clock_breakdown:
        t = engine.last_timings
        record.update(forward_s=t.forward, backward_s=t.backward, step_s=t.step, transfer_s=t.transfer,
                      communication_s=t.communication, host_optimizer_s=t.host_optimizer)
        if t.interleaved:  # pipeline schedules and layer-major streaming cannot split the two
            record["forward_backward_interleaved_s"] = t.interleaved
    return record


def _evaluate(engine: Engine, data: TokenBatches, batches: int, batch_size: int) -> float:
    return sum(engine.eval_batch(engine.local_batch(data.eval_batch(i, batch_size)))
               for i in range(batches)) / batches


def _save(engine: Engine, out: Path, step: int, keep: int, restarts: int = 0, async_save: bool = False,
          start: int | None = None, own: list[str] | None = None) -> Path:
    root = out / CHECKPOINTS
    if engine.parallel.is_writer:  # saves that can no longer finish (this process's own in flight stays)
        ckpt.remove_partial(root)
    path = engine.save_checkpoint(root / f"step-{step:07d}", client_state={"data_step": step, "restarts": restarts},
                                  async_save=async_save)
    if engine.parallel.is_writer:
        # Never a checkpoint newer than the run's start that it did not write, never the only good one.
        ckpt.prune(root, keep, start=start, own=[*(own or []), str(path)])
    return path


def _disk_full(exc: BaseException, engine: Engine, out: Path, step: int) -> BaseException:
    """``exc`` said in words when the disk is full: torch's writers report ENOSPC as an
    offset mismatch inside the zip container, which names neither the disk nor the fix."""
    try:
        free = shutil.disk_usage(out).free
    except OSError:
        return exc
    newest = latest_checkpoint(out)
    # The last checkpoint's size, else weights and two Adam moments of this rank's parameters.
    needed = _dir_bytes(newest) if newest is not None else 3 * sum(
        p.numel() * p.element_size() for p in engine.module.parameters())
    if free >= needed:
        return exc
    kept = f"the newest complete checkpoint is {newest}" if newest is not None else "no checkpoint yet"
    return OSError(errno.ENOSPC, f"the checkpoint of step {step} was not saved ({free / 2**20:.1f} MiB free, one "
                   f"takes about {needed / 2**20:.1f} MiB; {kept})", str(out))


def _dir_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (a checkpoint directory)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _fmt(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)
