"""Run a script on the real DeepSpeed on this CPU, without a JIT op build: the reference the
drop-in is compared with. Usage: python real_deepspeed.py SCRIPT ARGS…

DeepSpeed's CPU communication backend builds its shared-memory all-reduce op (a C++ JIT
build of ~100 s here) when the op reports itself compatible; with one process it only
replaces an all-reduce over one rank, so the op table is emptied and torch's gloo
collectives run instead. The math is DeepSpeed's own.

A gloo group still alive when the interpreter shuts down can abort the process after the
script finished ("terminate called without an active exception"), and a teardown at exit did
not always prevent it here: once the script has finished (its records written), the
reference leaves the group, flushes its output and ends without the interpreter's shutdown.
"""

import os
import runpy
import sys

import deepspeed.ops
import torch.distributed as dist

deepspeed.ops.__compatible_ops__ = {}
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
if dist.is_available() and dist.is_initialized():
    dist.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
