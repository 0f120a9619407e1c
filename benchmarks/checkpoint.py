"""Checkpoint save: sharded (every rank writes its own shards, format 2) against the
gathered format hybridtrain wrote before (format 1: full model and optimizer state
gathered, rank 0 writes ``model.pt``/``engine.pt``), on N ZeRO-3 ranks.

    python benchmarks/checkpoint.py [--ranks 2] [--d-model 1024] [--n-layer 8] [--repeats 2]

The script starts itself under ``hybridtrain``'s launcher (torchrun); after one training
step (so Adam's moments exist) each rank saves in both formats, in alternating order, and
rank 0 reports, per format:

- save seconds (until every rank returned; for the background save: until the call
  returned, and until the checkpoint was committed);
- rank 0's extra peak host memory during the save (resident set sampled every 2 ms,
  minus the resident set before the save) — the cost of gathering through one process;
- the ratio of the gathered format's figures to the sharded ones' (same run, same machine).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


class PeakRss:
    """Samples this process's resident set in a thread; ``extra`` = peak − start."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakRss:
        self.start = self.peak = _rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(self.interval)

    @property
    def extra(self) -> int:
        return self.peak - self.start


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _gathered_save(engine: Any, path: Path) -> None:
    """What format 1 did: full states gathered (collectives on every rank), rank 0 writes
    each file, syncs it and records its SHA-256 (format 2 checksums every shard too)."""
    model = engine.parallel.model_state_dict()
    optimizer = engine.parallel.optimizer_state_dict(engine.optimizer)
    if engine.parallel.is_writer:
        path.mkdir(parents=True)
        for name, state in (("model.pt", model), ("engine.pt", {"optimizer": optimizer})):
            with open(path / name, "wb") as fh:
                torch.save(state, fh)
                fh.flush()
                os.fsync(fh.fileno())
            digest = hashlib.sha256()
            with open(path / name, "rb") as fh:
                for chunk in iter(lambda f=fh: f.read(1 << 20), b""):
                    digest.update(chunk)
    engine.parallel.barrier()


def _measure(engine: Any, save: Callable[[], Any], finish: Callable[[], Any] | None = None) -> dict[str, float]:
    engine.parallel.barrier()
    with PeakRss() as rss:
        start = time.perf_counter()
        save()
        returned = time.perf_counter() - start
        if finish is not None:
            finish()
        engine.parallel.barrier()
        total = time.perf_counter() - start
    return {"returned_s": returned, "total_s": total, "extra_rss": float(rss.extra)}


def worker(d_model: int, n_layer: int, repeats: int, out_dir: str) -> None:
    """One rank: a ZeRO-3 step, then both formats ``repeats`` times."""
    import hybridtrain as ht
    from hybridtrain import checkpoint as ckpt
    from hybridtrain.models.gpt import GPT, GPTConfig, causal_lm_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=n_layer, n_head=8, d_model=d_model, seq_len=32, vocab_size=256))
    params = sum(p.numel() for p in model.parameters())
    engine = ht.initialize(model, {"device": "cpu", "train_batch_size": 2 * engine_world(),
                                   "zero_optimization": {"stage": 3}}, loss_fn=causal_lm_loss)
    tokens = torch.randint(0, 256, (2 * engine_world(), 33), generator=torch.Generator().manual_seed(1))
    engine.train_batch(engine.local_batch((tokens[:, :-1], tokens[:, 1:])))
    root = Path(out_dir)
    rows: dict[str, list[dict[str, float]]] = {"gathered": [], "sharded": [], "sharded_async": []}
    for i in range(repeats):
        order = ["gathered", "sharded", "sharded_async"] if i % 2 == 0 else ["sharded_async", "sharded", "gathered"]
        for fmt in order:
            path = root / f"{fmt}-{i}"
            if fmt == "gathered":
                rows[fmt].append(_measure(engine, lambda p=path: _gathered_save(engine, p)))
            elif fmt == "sharded":
                rows[fmt].append(_measure(engine, lambda p=path: engine.save_checkpoint(p)))
            else:
                rows[fmt].append(_measure(engine, lambda p=path: engine.save_checkpoint(p, async_save=True),
                                          ckpt.wait_for_pending))
    if engine.parallel.is_writer:
        sizes = {fmt: sum(f.stat().st_size for f in (root / f"{fmt}-0").rglob("*") if f.is_file()) for fmt in rows}
        Path(out_dir, "result.json").write_text(json.dumps({"params": params, "rows": rows, "bytes": sizes}))


def engine_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", metavar="OUT_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        worker(args.d_model, args.n_layer, args.repeats, args.worker)
        return 0

    from hybridtrain.parallel.launch import LaunchSpec, launch

    with tempfile.TemporaryDirectory() as out:
        worker_args = ["--d-model", str(args.d_model), "--n-layer", str(args.n_layer), "--repeats",
                       str(args.repeats), "--worker", out]
        code = launch(LaunchSpec(nproc_per_node=str(args.ranks)), __file__, worker_args)
        if code:
            return code
        result = json.loads(Path(out, "result.json").read_text())
    rows: dict[str, list[dict[str, float]]] = result["rows"]
    best = {fmt: {"returned_s": min(r["returned_s"] for r in runs), "total_s": min(r["total_s"] for r in runs),
                  "extra_rss": max(r["extra_rss"] for r in runs)} for fmt, runs in rows.items()}
    print(f"# ZeRO-3 GPT, {result['params'] / 1e6:.1f} M parameters, {args.ranks} ranks (gloo), "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
          f"best of {args.repeats} (time: min, memory: max)")
    print("| format | save call s | until committed s | rank-0 extra peak host MiB | bytes on disk MiB |")
    print("|---|---|---|---|---|")
    for fmt, b in best.items():
        print(f"| {fmt} | {b['returned_s']:.2f} | {b['total_s']:.2f} | {b['extra_rss'] / 2**20:.0f} "
              f"| {result['bytes'][fmt] / 2**20:.0f} |")
    g, s = best["gathered"], best["sharded"]
    print(f"gathered / sharded: save time {g['total_s'] / s['total_s']:.2f}x, rank-0 extra peak host memory "
          f"{g['extra_rss'] / max(s['extra_rss'], 2**20):.1f}x (sharded counted as at least 1 MiB); "
          "background save returns "
          f"{g['total_s'] / best['sharded_async']['returned_s']:.2f}x sooner than the gathered save")
    return 0


if __name__ == "__main__":
    sys.exit(main())
