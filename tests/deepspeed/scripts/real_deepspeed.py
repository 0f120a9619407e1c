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

With ``HYBRIDTRAIN_REFERENCE_FP16=1`` the reference runs fp16, which DeepSpeed refuses on a CPU
without mkldnn fp16 ("Type fp16 is not supported on your device"; torch computes fp16 on any
CPU): its CPU accelerator is told fp16 is supported. DeepSpeed 0.19.8's engine also never calls
the ZeRO-0 fp16 wrappers' ``backward`` (their gradients are not scaled, then unscaled anyway);
there the reference scales the loss as those wrappers' ``backward`` does (``loss.float() *
cur_scale``) before the engine's backward, so the comparison is with their arithmetic as written.
"""

import os
import runpy
import sys

import deepspeed.ops
import torch.distributed as dist

deepspeed.ops.__compatible_ops__ = {}
if os.environ.get("HYBRIDTRAIN_REFERENCE_FP16") == "1":
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    CPU_Accelerator.is_fp16_supported = lambda self: True
    _engine_backward = DeepSpeedEngine.backward

    def _backward_scaled_as_the_wrappers(self, loss, *args, **kwargs):
        wrapper = self.optimizer
        if isinstance(wrapper, FP16_Optimizer | FP16_UnfusedOptimizer) and wrapper.loss_scale_config.use_grad_scaling:
            loss = loss.float() * wrapper.loss_scale_config.cur_scale
        return _engine_backward(self, loss, *args, **kwargs)

    DeepSpeedEngine.backward = _backward_scaled_as_the_wrappers
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
if dist.is_available() and dist.is_initialized():
    dist.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
