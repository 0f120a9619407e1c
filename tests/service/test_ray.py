"""The Ray backend against a real local Ray cluster (``ray start --head``, started once for
this module with a timeout and stopped after it): a job on two nodes runs ``hybridtrain
launch`` on each, and their ranks form one process group across the nodes."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridtrain.service.devices import parse_slots
from hybridtrain.service.local import LocalBackend
from hybridtrain.service.scheduler import Scheduler
from hybridtrain.service.spec import load_job_spec
from hybridtrain.service.store import JobStore
from tests.hpo.conftest import free_port
from tests.service.conftest import tiny_config, wait_for

pytest.importorskip("ray.job_submission")
pytestmark = pytest.mark.timeout(300)

ALLREDUCE = """\
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: sum {t.item():g}", flush=True)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def ray_head() -> Iterator[str]:
    """A one-node Ray cluster (2 CPUs) with its job server; its address."""
    ray_bin = Path(sys.executable).with_name("ray")
    temp = Path(tempfile.mkdtemp(prefix="ht-ray-"))
    dashboard = free_port()
    proc = subprocess.Popen(
        [str(ray_bin), "start", "--head", "--block", "--num-cpus", "2", "--port",
         str(free_port()), "--dashboard-port", str(dashboard), "--include-dashboard", "true",
         "--disable-usage-stats", "--temp-dir", str(temp), "--ray-client-server-port",
         str(free_port()), "--dashboard-agent-listen-port", "0"],
        stdout=(temp / "head.log").open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True, env=os.environ | {"RAY_JOB_STOP_WAIT_TIME_S": "60"})
    address = f"http://127.0.0.1:{dashboard}"

    def up() -> bool:
        try:
            with urllib.request.urlopen(f"{address}/api/version", timeout=3):
                return True
        except OSError:
            return proc.poll() is not None

    try:
        wait_for(up, 120, "the Ray head's job server")
        assert proc.poll() is None, (temp / "head.log").read_text()[-2000:]
        yield address
    finally:
        # --block: `ray start` stops the head's processes when it gets SIGTERM; they are
        # all in its session, so whatever is left after that is killed, and nothing else.
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(15)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        shutil.rmtree(temp, ignore_errors=True)


def test_a_job_runs_launch_on_two_ray_nodes(ray_head: str, tmp_path: Path) -> None:
    from hybridtrain.service.ray_backend import RayBackend

    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    slots = parse_slots("cpu:2")
    store = JobStore(f"sqlite:///{tmp_path / 'service.db'}")
    scheduler = Scheduler(store, slots, {"local": LocalBackend(slots),
                                         "ray": RayBackend(ray_head)})
    spec = load_job_spec({"name": "on-ray", "command": [str(script)], "devices": 1,
                          "nodes": 2, "backend": "ray", "workdir": str(tmp_path)})
    store.submit(spec, str(tmp_path / "jobs" / "on-ray"))
    wait_for(lambda: store.get("on-ray").state not in ("queued", "running"), 180,
             "the Ray job to end", scheduler.tick)
    job = store.get("on-ray")
    log = (tmp_path / "jobs" / "on-ray" / "output.log").read_text()
    assert job.state == "succeeded", (job.reason, log[-3000:])
    assert job.backend_ref and job.backend_ref.startswith("hybridtrain-on-ray-")
    # Two nodes, each one rank of `hybridtrain launch`, in one group: 1 + 2 = 3.
    assert "-m hybridtrain launch" in log
    assert "rank 0 of 2: sum 3" in log and "rank 1 of 2: sum 3" in log
    # A log a person reads: no terminal colour codes, each node's devices named, and a
    # successful run free of the C++ stack traces torch's elastic agent prints on shutdown.
    assert "\x1b[" not in log, log[-3000:]
    assert "node 0 of 2 on " in log and "node 1 of 2 on " in log, log[-3000:]
    assert "Exception raised from" not in log and "frame #" not in log, log[-6000:]


def test_a_training_job_on_ray_is_cancelled_with_a_checkpoint(ray_head: str,
                                                              tmp_path: Path) -> None:
    from hybridtrain.service.ray_backend import RayBackend

    cfg = tiny_config(tmp_path / "tiny.yaml", steps=400, checkpoint_every=3)
    slots = parse_slots("cpu:2")
    store = JobStore(f"sqlite:///{tmp_path / 'service.db'}")
    scheduler = Scheduler(store, slots, {"local": LocalBackend(slots),
                                         "ray": RayBackend(ray_head)})
    store.submit(load_job_spec({"name": "train-on-ray", "config": str(cfg), "backend": "ray",
                                "kill_grace": 60}), str(tmp_path / "jobs" / "train-on-ray"))
    checkpoints = tmp_path / "jobs" / "train-on-ray" / "run" / "checkpoints"
    wait_for(lambda: any(checkpoints.glob("step-*")), 150, "a checkpoint on Ray",
             scheduler.tick)
    store.cancel("train-on-ray")
    wait_for(lambda: store.get("train-on-ray").state not in ("queued", "running"), 120,
             "the cancel", scheduler.tick)
    job = store.get("train-on-ray")
    log = (tmp_path / "jobs" / "train-on-ray" / "output.log").read_text()
    assert job.state == "cancelled", (job.reason, log[-3000:])
    assert job.exit_code == 130 and "saved a checkpoint and stopped" in job.reason, job.reason
    saved = sorted(checkpoints.glob("step-*"))
    assert saved and int(saved[-1].name.split("-")[1]) < 400
