"""Kill the training service with SIGKILL at random moments while it runs training jobs,
and check that nothing was lost or run twice.

    python scripts/service_kill_soak.py [--jobs 4] [--kills 5] [--steps 30] [--seed 0]

Starts `hybridtrain serve` (2 CPU slots) on a fresh storage, submits tiny GPT training
jobs, SIGKILLs the service after a random 1-8 s, starts it again, K times, then waits for
the jobs. Every job must succeed in exactly one attempt (it was adopted, never restarted
or started twice) and its metrics.jsonl must read as one uninterrupted run (steps 1..N).
Exit 0 when all hold; prints one line per check.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hybridtrain.service.client import Client  # noqa: E402
from hybridtrain.service.transport import healthy  # noqa: E402

TOKEN = "soak-token-0123456789abcdef"


def _serve(work: Path, storage: str, tag: str) -> tuple[subprocess.Popen[bytes], Client]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | {"HYBRIDTRAIN_HPO_TOKEN": TOKEN, "HYBRIDTRAIN_SERVICE_DEVICES": "cpu:2",
                        "PYTHONPATH": str(REPO)}
    with (work / f"serve-{tag}.log").open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "hybridtrain", "serve", "--port",
                                 str(port), "--storage", storage, "--jobs-dir",
                                 str(work / "jobs")], cwd=work, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while not healthy(base):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"serve did not start: {(work / f'serve-{tag}.log').read_text()}")
        time.sleep(0.2)
    return proc, Client(base, TOKEN)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="service-soak-"))
    storage = f"sqlite:///{work / 'service.db'}"
    config = work / "tiny.yaml"
    config.write_text("device: cpu\nmodel: {name: gpt-tiny, overrides: {n_layer: 1}}\n"
                      "data: {seq_len: 16}\ntrain_batch_size: 4\n"
                      f"train: {{steps: {args.steps}, checkpoint_every: 5, eval_every: 0}}\n")
    proc, client = _serve(work, storage, "0")
    for i in range(args.jobs):
        client.call("POST", "/v1/jobs", {"name": f"soak-{i}", "config": str(config)})
    for k in range(args.kills):
        time.sleep(rng.uniform(1.0, 8.0))
        states = [j["state"] for j in client.call("GET", "/v1/jobs")]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        print(f"kill -9 #{k + 1} with jobs {states}", flush=True)
        proc, client = _serve(work, storage, str(k + 1))
    deadline = time.monotonic() + 900
    while any(j["state"] in ("queued", "running") for j in client.call("GET", "/v1/jobs")):
        if time.monotonic() > deadline:
            raise SystemExit("jobs did not finish in 15 minutes")
        time.sleep(1)
    proc.terminate()
    proc.wait(30)
    ok = True
    for job in client_jobs(work, storage):
        steps = [json.loads(line)["step"] for line in
                 (Path(job["job_dir"]) / "run" / "metrics.jsonl").open()]
        distinct = [s for i, s in enumerate(steps) if i == 0 or s != steps[i - 1]]
        good = (job["state"] == "succeeded" and job["attempt"] == 1
                and distinct == list(range(1, args.steps + 1)))
        ok &= good
        print(f"{job['name']}: {job['state']}, attempts {job['attempt']}, steps "
              f"{distinct[0]}..{distinct[-1]} ({len(distinct)} distinct): "
              f"{'ok' if good else 'WRONG'}", flush=True)
    print("soak:", "passed" if ok else "FAILED", f"({work})")
    return 0 if ok else 1


def client_jobs(work: Path, storage: str) -> list[dict]:
    from hybridtrain.service.store import JobStore

    return [j.as_dict() for j in JobStore(storage).jobs()]


if __name__ == "__main__":
    sys.exit(main())
