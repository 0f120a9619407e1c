"""Measure what the estimator predicts: the peak of live tensor bytes and the seconds of a
training step, on this machine (a CPU run is what ``benchmarks/planner.py`` and the
planner's tests compare with)."""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass

from hybridtrain.compose import initialize
from hybridtrain.config import ConfigSource, load_config
from hybridtrain.data import TokenBatches, load_tokens
from hybridtrain.models.factory import build_model
from hybridtrain.models.gpt import causal_lm_loss
from hybridtrain.runtime.device import resolve_device
from hybridtrain.runtime.memory_limit import LiveTensorBytes


@dataclass(frozen=True)
class Measurement:
    """A real step of a config.

    Attributes:
        peak_bytes: peak live tensor bytes on the device during one steady-state step
            (after one warm-up step, so the optimizer state exists), less what was live in
            the process before the model was built (another engine's leftovers).
        step_seconds: median seconds of the timed steps (measured without the counter).
        losses: the loss of every step run.
    """

    peak_bytes: int
    step_seconds: float
    losses: list[float]


def measure_step(config: ConfigSource, timed_steps: int = 2) -> Measurement:
    """Build the config's model and data as ``hybridtrain train`` does, run a warm-up
    step, count the live bytes of the next one, then time ``timed_steps`` more."""
    cfg = load_config(config)
    gc.collect()
    with LiveTensorBytes(resolve_device(cfg.device)) as before:
        pass
    data = TokenBatches(load_tokens(cfg.data.path), cfg.data.seq_len, cfg.data.val_fraction, cfg.seed)
    vocab = int(cfg.model.overrides.get("vocab_size", max(256, data.max_token + 1)))
    model = build_model(cfg.model.name, cfg.model.overrides, vocab, cfg.data.seq_len, cfg.seed)
    micro = cfg.train_micro_batch_size_per_gpu or 1
    engine = initialize(model, cfg, loss_fn=causal_lm_loss, example_batch=data.train_batch(0, micro))
    batch_size = engine.options.batch.global_batch
    losses = [engine.train_batch(engine.local_batch(data.train_batch(0, batch_size)))]
    batch = engine.local_batch(data.train_batch(1, batch_size))
    gc.collect()  # what earlier runs in this process left in reference cycles must not count
    with LiveTensorBytes(engine.device) as live:
        losses.append(engine.train_batch(batch))
    seconds = []
    for step in range(timed_steps):
        batch = engine.local_batch(data.train_batch(2 + step, batch_size))
        start = time.perf_counter()
        losses.append(engine.train_batch(batch))
        seconds.append(time.perf_counter() - start)
    close = getattr(engine.optimizer, "close", None)
    if callable(close):
        close()
    del engine, model
    gc.collect()
    return Measurement(live.peak_bytes - before.current_bytes, statistics.median(seconds) if seconds else 0.0,
                       losses)
