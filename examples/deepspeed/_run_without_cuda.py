"""Run a DeepSpeed example whose ``__main__`` calls ``torch.cuda.set_device`` on a machine
without CUDA (a CPU-only torch raises there): that call does nothing then, the script is
run unchanged. ``python _run_without_cuda.py SCRIPT.py ARGS…`` (or under
``hybridtrain launch``)."""

import runpy
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    torch.cuda.set_device = lambda device: None  # the CPU is the only device
script = Path(sys.argv[1])
sys.argv = sys.argv[1:]
sys.path.insert(0, str(script.resolve().parent))
runpy.run_path(str(script), run_name="__main__")
