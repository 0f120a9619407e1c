"""Metrics overhead: step time of ``hybridtrain train`` with and without the Prometheus
endpoint (scraped while it trains) plus the TensorBoard and CSV monitors, measured in one run.

    python benchmarks/metrics_overhead.py [--model gpt-mini] [--batch 8] [--steps 20] [--rounds 12]
                                          [--scrape-interval 1] [--device auto]

Rounds alternate (off, on, off, on …) so drift in machine speed hits both. A round is a
real ``run_training`` call; its step time is the wall time between consecutive metrics.jsonl
step records (training step plus all per-step bookkeeping, so the publishing cost is inside),
the median over the round's steps after the first. The figure is the median over rounds of
on/off (the fastest rounds' ratio is printed too: on a shared machine it is the least
noisy). A scraper thread reads ``/metrics`` every ``--scrape-interval`` seconds (Prometheus
scrapes every 15–60 s; the default is 15× more often). Also printed: what one
``publish`` (the training thread's whole share) and one scrape cost. Goal: < 1 %.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

import hybridtrain.trainer as trainer
from hybridtrain.config import load_config
from hybridtrain.metrics import MetricsLog
from hybridtrain.monitoring.prometheus import MetricsServer
from hybridtrain.monitoring.telemetry import Telemetry


class TimedLog(MetricsLog):
    """metrics.jsonl that also notes when each step record was written."""

    stamps: list[float] = []

    def write(self, record: dict[str, Any]) -> None:
        super().write(record)
        if "loss" in record:
            TimedLog.stamps.append(time.perf_counter())


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def one_round(base: dict[str, Any], on: bool, out: Path, interval: float) -> tuple[float, int]:
    """Median seconds per step of one run, and how many scrapes answered during it."""
    raw = {**base, "train": {**base["train"], "output_dir": str(out)}}
    port = free_port()
    if on:
        raw.update(tensorboard={"enabled": True}, csv_monitor={"enabled": True})
        raw["train"]["metrics_port"] = port
    TimedLog.stamps = []
    stop, scrapes = threading.Event(), [0]

    def scraper() -> None:
        while not stop.wait(interval):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
                    r.read()
                scrapes[0] += 1
            except OSError:
                pass

    thread = threading.Thread(target=scraper, daemon=True)
    if on:
        thread.start()
    try:
        trainer.run_training(load_config(raw), progress=False)
    finally:
        stop.set()
    gaps = [b - a for a, b in zip(TimedLog.stamps, TimedLog.stamps[1:], strict=False)]
    return statistics.median(gaps[1:]), scrapes[0]


class _Discard:
    """A monitor that writes nowhere (the queue hand-off is what the training thread pays)."""

    def write_events(self, events: Any) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def publish_cost(record: dict[str, Any], n: int = 20000) -> tuple[float, float]:
    """Seconds per publish (endpoint update + monitor hand-off) and per scrape render."""
    from prometheus_client import generate_latest

    from hybridtrain.monitoring.monitors import MonitorSet

    telemetry = Telemetry(load_config({"train": {"metrics_port": free_port()}}))
    telemetry.start_server()
    telemetry.monitors = MonitorSet([_Discard()])
    telemetry.samples_per_step = 8
    start = time.perf_counter()
    for i in range(n):
        telemetry.publish({**record, "step": i})
    per_publish = (time.perf_counter() - start) / n
    server: MetricsServer | None = telemetry.server
    assert server is not None
    start = time.perf_counter()
    for _ in range(200):
        generate_latest(server.registry)
    per_scrape = (time.perf_counter() - start) / 200
    telemetry.close()
    return per_publish, per_scrape


def monitor_cost(record: dict[str, Any], n: int = 500) -> float:
    """CPU seconds (all threads) per step that the TensorBoard and CSV monitors' background
    writing costs: off the training thread, but on the same cores."""
    from hybridtrain.monitoring.monitors import CSVMonitor, TensorBoardMonitor, events_of

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "csv").mkdir()
        monitors = [TensorBoardMonitor(Path(tmp) / "tb"), CSVMonitor(Path(tmp) / "csv")]
        start = time.process_time()
        for i in range(n):
            events = events_of({**record, "step": i + 1}, 8 * (i + 1))
            for monitor in monitors:
                monitor.write_events(events)
        for monitor in monitors:
            monitor.close()
        return (time.process_time() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20, help="steps per round")
    parser.add_argument("--rounds", type=int, default=12, help="rounds of each kind")
    parser.add_argument("--scrape-interval", type=float, default=1.0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()
    trainer.MetricsLog = TimedLog  # type: ignore[misc]
    base: dict[str, Any] = {
        "model": {"name": args.model}, "data": {"seq_len": args.seq_len}, "train_batch_size": args.batch,
        "steps_per_print": 10**6, "bf16": {"enabled": args.bf16},
        "train": {"steps": args.steps, "eval_batches": 1, "keep_checkpoints": 1},
    }
    if args.device != "auto":
        base["device"] = args.device
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    name = torch.cuda.get_device_name() if device.startswith("cuda") else f"CPU ({torch.get_num_threads()} threads)"
    print(f"{args.model}, batch {args.batch}×{args.seq_len}, {args.steps} steps × {args.rounds} rounds each, "
          f"on {name}; scrape every {args.scrape_interval:g} s")
    off_times, on_times, ratios = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        one_round(base, False, Path(tmp) / "warm", args.scrape_interval)  # warm-up (allocator, kernels)
        for r in range(args.rounds):
            off, _ = one_round(base, False, Path(tmp) / f"off{r}", args.scrape_interval)
            on, scrapes = one_round(base, True, Path(tmp) / f"on{r}", args.scrape_interval)
            off_times.append(off)
            on_times.append(on)
            ratios.append(on / off)
            print(f"round {r + 1}: off {off * 1e3:8.2f} ms/step   on {on * 1e3:8.2f} ms/step   "
                  f"on/off {on / off:.4f}   ({scrapes} scrapes)", flush=True)
    per_publish, per_scrape = publish_cost({"step": 0, "loss": 2.0, "lr": 1e-3, "tokens_per_s": 1e4,
                                            "peak_memory_bytes": 1 << 30, "samples_per_s": 10.0,
                                            "tflops": 1.0, "step_time_s": 0.1, "data_s": 0.001})
    per_monitor = monitor_cost({"loss": 2.0, "lr": 1e-3, "tokens_per_s": 1e4, "peak_memory_bytes": 1 << 30,
                                "samples_per_s": 10.0, "tflops": 1.0, "step_time_s": 0.1, "data_s": 0.001})
    median_off = statistics.median(off_times)
    ratio = statistics.median(ratios)
    print(f"median step: off {median_off * 1e3:.2f} ms, on {statistics.median(on_times) * 1e3:.2f} ms; "
          f"fastest round: off {min(off_times) * 1e3:.2f} ms, on {min(on_times) * 1e3:.2f} ms "
          f"(on/off {min(on_times) / min(off_times):.4f})")
    print(f"publish on the training thread: {per_publish * 1e6:.1f} µs/step "
          f"({100 * per_publish / median_off:.4f} % of a step); one scrape renders in {per_scrape * 1e3:.2f} ms")
    print(f"TensorBoard + CSV writing on the monitor thread: {per_monitor * 1e6:.0f} µs CPU/step "
          f"({100 * per_monitor / median_off:.3f} % of a step)")
    print(f"overhead (median on/off over rounds): {100 * (ratio - 1):+.2f} %  (goal < 1 %)")


if __name__ == "__main__":
    main()
