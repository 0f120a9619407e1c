"""Run a script on the real DeepSpeed on this CPU, without a JIT op build: the reference the
drop-in is compared with. Usage: python real_deepspeed.py SCRIPT ARGS…

DeepSpeed's CPU communication backend builds its shared-memory all-reduce op (a C++ JIT
build of ~100 s here) when the op reports itself compatible; with one process it only
replaces an all-reduce over one rank, so the op table is emptied and torch's gloo
collectives run instead. The math is DeepSpeed's own.
"""

import os
import runpy
import sys

import deepspeed.ops

deepspeed.ops.__compatible_ops__ = {}
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
