"""The equivalence suites again on AVX2 kernels: a mode exact only with one instruction
set's kernels fails on every x86 machine, not only on a user's CPU.

The engine and the plain loop must run the same ops on the same kernels (see
``plain_optimizers`` and ``reduced_precision_tolerance`` in tests/equivalence.py). On a CPU
with AVX-512, torch and oneDNN pick AVX-512 kernels by default; forcing AVX2 (the same
variables a user would set) picks other ones, with other roundings. Both runs must pass.

The AVX2 run takes the half-precision cells (bf16, fp16, half-width transfers): there one
ulp of a different kernel crosses a rounding boundary and shows (issue #38's cells were all
of them). An fp32 cell compares at rtol 1e-5, far above any kernel's rounding, and runs on
the default kernels in the main suite. Of the Hugging Face families it takes one per kind of
architecture (GPT-2's Conv1D, Llama's RMSNorm and rotary, Mixtral's experts, RoBERTa's masked LM,
T5's encoder-decoder, Mamba's scans): the kernels a family adds are its kind's, and the
optimizer kernels that differ between instruction sets (issue #38) are the same in all of them.
The default run covers every family.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SUITES = ["tests/test_equivalence.py", "tests/models/test_hf_families.py"]
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
#: The cells in half precision, the shared suite's and one family per kind (module docstring).
HALF_CELLS = "(bf16 or fp16 or half) and (test_equivalence or gpt2 or llama or mixtral or roberta or t5 or mamba)"


def _capability(env: dict[str, str]) -> str:
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return done.stdout.strip()


@pytest.mark.timeout(1800)
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="AVX2 kernels exist on x86 only")
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2"),
                    reason="this CPU's default kernels are AVX2 or older: the default run covers them")
def test_equivalence_suites_pass_on_avx2_kernels() -> None:
    env = {**os.environ, **AVX2}
    assert _capability(env) == "AVX2"  # the variables took effect: the run below is another kernel path
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", HALF_CELLS, *SUITES],
                          cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=1700)
    assert done.returncode == 0, f"on AVX2 kernels:\n{done.stdout[-6000:]}{done.stderr[-2000:]}"
