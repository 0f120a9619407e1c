"""No stream race in the offload techniques (CUDA only).

Every technique here copies on side streams while the device computes. A missing event
or ``record_stream`` shows up as a result that depends on timing, so each mode trains once
with asynchronous launches and once with ``CUDA_LAUNCH_BLOCKING=1`` (every launch waits
for the device: no copy overlaps anything), and the results must agree; and once under
PyTorch's CUDA sanitizer (``TORCH_CUDA_SANITIZER=1``), which reports any access to a
tensor from a stream not ordered after the previous writer, and fails the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.equivalence import MODES

pytestmark = pytest.mark.cuda

RACE_MODES = ["swap", "swap_checkpoint_bf16", "offload_opt", "offload_opt_accum2_clip", "offload_opt_twinflow_fp16",
              "stream", "stream_host_accum2_clip", "stream_device_bf16", "stream_layer_major_accum4",
              "stream_layer_major_host_accum2_clip",
              # half-width images cast and uploaded from the caster thread; gradients
              # narrowed to half on the copy stream
              "stream_bf16_accum2_clip", "stream_layer_major_host_bf16_accum2_clip", "offload_opt_bf16_accum2_clip"]
ROOT = Path(__file__).resolve().parents[3]


def _train(mode: str, out: Path, **env: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "tests.runtime.stream_race_run", mode, str(out)], cwd=ROOT,
                            env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out)


@pytest.mark.parametrize("mode", RACE_MODES)
def test_asynchronous_equals_launch_blocking(mode: str, tmp_path: Path) -> None:
    overlapped = _train(mode, tmp_path / "async.pt")
    serial = _train(mode, tmp_path / "blocking.pt", CUDA_LAUNCH_BLOCKING="1")
    half = MODES[mode].autocast_dtype is not None
    tol = {"rtol": 1e-3, "atol": 1e-4} if half else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(torch.tensor(overlapped["losses"]), torch.tensor(serial["losses"]), **tol)
    for name, value in serial["state"].items():
        torch.testing.assert_close(overlapped["state"][name], value, **tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("mode", RACE_MODES)
def test_cuda_sanitizer_finds_no_unsynchronized_access(mode: str, tmp_path: Path) -> None:
    _train(mode, tmp_path / "sanitized.pt", TORCH_CUDA_SANITIZER="1")
