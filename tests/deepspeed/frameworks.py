"""Run a framework script twice — on the real DeepSpeed (CPU, no op build) and on hybridtrain's
drop-in in an environment without DeepSpeed — and read what each run recorded."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import torch

SCRIPTS = Path(__file__).resolve().parent / "scripts"
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def deepspeed_free_site(tmp: Path) -> Path:
    """A copy of this interpreter's site-packages as links, without ``deepspeed``: the
    drop-in run cannot import the real package, nor read its metadata."""
    site = Path(sysconfig.get_paths()["purelib"])
    target = tmp / "site-without-deepspeed"
    target.mkdir(exist_ok=True)
    for entry in site.iterdir():
        if entry.name == "deepspeed" or entry.name.lower().startswith("deepspeed-"):
            continue
        link = target / entry.name
        if not link.exists():
            link.symlink_to(entry)
    return target


def poisoned_deepspeed(tmp: Path) -> Path:
    """A directory that, first on the path, makes the real DeepSpeed unusable: its
    ``deepspeed`` raises on import and its metadata says version 0.0.0 (below every
    framework's minimum). Ranks started by a launcher do not inherit ``-S``; with this first
    on their path, only the drop-in can serve them."""
    target = tmp / "poisoned-deepspeed"
    (target / "deepspeed").mkdir(parents=True, exist_ok=True)
    (target / "deepspeed" / "__init__.py").write_text(
        'raise ImportError("the real deepspeed was imported; the drop-in should have served this import")\n')
    info = target / "deepspeed-0.0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.0.0\n")
    return target


def start(script: str, args: list[str], tmp: Path, real: bool, env: dict[str, str] | None = None,
          nproc: int = 1, dropin: bool = True, launcher_env: bool = True) -> subprocess.Popen[str]:
    """Start ``script`` on the real DeepSpeed (``real``) or on hybridtrain's drop-in with no
    usable DeepSpeed: one process as ``python -S -m hybridtrain.deepspeed`` (no site-packages
    but a copy without DeepSpeed), several as ``hybridtrain launch`` with a poisoned DeepSpeed
    first on the path (:func:`poisoned_deepspeed`). One process gets a launcher's variables
    (``RANK`` …) unless ``launcher_env`` is False."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "PL_"))}
    environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1",
                    "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    **(env or {})})
    if nproc > 1 or not launcher_env:  # a launcher's variables: set by the launcher, or none at all
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            environ.pop(key)
    path = [str(SCRIPTS)]
    target = [str(SCRIPTS / script), *args]
    if real:
        runner = [str(SCRIPTS / "real_deepspeed.py")]
        command = [sys.executable, *(["-m", "torch.distributed.run", f"--nproc-per-node={nproc}"] if nproc > 1
                                     else []), *runner, *target]
        path.append(str(ROOT))
    elif nproc > 1:
        command = [sys.executable, "-m", "hybridtrain", "launch", "--nproc-per-node", str(nproc), *target]
        path = [str(poisoned_deepspeed(tmp)), *path, str(ROOT)]
    else:  # without the drop-in's entry point (dropin False) the script installs it itself
        command = [sys.executable, "-S", *(["-m", "hybridtrain.deepspeed"] if dropin else []), *target]
        path += [str(ROOT), str(deepspeed_free_site(tmp))]
    environ["PYTHONPATH"] = os.pathsep.join(path)
    return subprocess.Popen(command, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp)


def run_dropin(script: str, args: list[str], tmp: Path, nproc: int = 1, env: dict[str, str] | None = None) -> None:
    """``script ARGS…`` on hybridtrain's drop-in: on one rank in this process, through the script's
    ``run(deepspeed, args)`` with ``hybridtrain.deepspeed`` (no launch: a second of the test's time
    instead of several), on one thread as a launched run (``OMP_NUM_THREADS=1``), so its kernels sum
    in the same order; on several ranks under ``hybridtrain launch`` (:func:`start`)."""
    if nproc > 1:
        finish(start(script, args, tmp, real=False, env=env, nproc=nproc), f"hybridtrain's run of {script}")
        return
    import importlib

    import hybridtrain.deepspeed

    saved_env, threads = dict(os.environ), torch.get_num_threads()
    sys.path.insert(0, str(SCRIPTS))
    try:
        os.environ.update(env or {})
        torch.set_num_threads(1)
        importlib.import_module(Path(script).stem).run(hybridtrain.deepspeed, args)
    finally:
        sys.path.remove(str(SCRIPTS))
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(saved_env)


def finish(process: subprocess.Popen[str], what: str, timeout: float = 240) -> str:
    """Wait for a run; its output, or an AssertionError with its end."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise AssertionError(f"{what} timed out:\n{err[-4000:]}") from None
    if process.returncode != 0:
        raise AssertionError(f"{what} failed:\n{out[-3000:]}\n{err[-6000:]}")
    return out + err


def run_both(script: str, args: list[str], tmp: Path, env: dict[str, str] | None = None,
             nproc: int = 1) -> tuple[Path, Path]:
    """``script ARGS… OUT`` on the real DeepSpeed and on hybridtrain, side by side (two
    processes at once); returns the two OUT paths (``theirs``, ``ours``)."""
    theirs, ours = tmp / "real", tmp / "hybridtrain"
    theirs.mkdir()
    ours.mkdir()
    real = start(script, [*(a.format(work=theirs) for a in args), str(theirs / "record")], tmp, True, env, nproc)
    mine = start(script, [*(a.format(work=ours) for a in args), str(ours / "record")], tmp, False, env, nproc)
    finish(real, f"the real DeepSpeed's run of {script}")
    finish(mine, f"hybridtrain's run of {script}")
    return theirs / "record", ours / "record"


def record(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """What a run wrote: its record and its final parameters."""
    return json.loads(path.read_text()), torch.load(str(path) + ".pt")


def assert_same_run(ours: Path, theirs: Path, rtol: float = 1e-4) -> None:
    """Same optimizer steps, learning rates, losses and final parameters (fp32, ``rtol``)."""
    mine, my_params = record(ours)
    real, real_params = record(theirs)
    assert "+hybridtrain" in mine["deepspeed"] and "+hybridtrain" not in real["deepspeed"], (mine, real)
    assert mine["steps"] == real["steps"], (mine["steps"], real["steps"])
    torch.testing.assert_close(torch.tensor(mine["lrs"]), torch.tensor(real["lrs"]), rtol=rtol, atol=0)
    torch.testing.assert_close(torch.tensor(mine["losses"]), torch.tensor(real["losses"]), rtol=rtol, atol=0)
    assert my_params.keys() == real_params.keys()
    if "grad_norms" in real:
        torch.testing.assert_close(torch.tensor(mine["grad_norms"]), torch.tensor(real["grad_norms"]), rtol=rtol,
                                   atol=0)
    for name, value in real_params.items():
        torch.testing.assert_close(my_params[name], value, rtol=rtol, atol=1e-6)
