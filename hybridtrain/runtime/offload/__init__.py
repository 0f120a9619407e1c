"""Optimizer offload (ZeRO-Offload) on one process: fp32 master weights, gradients and
optimizer state in host memory, updated by a host worker while backward continues.

- :mod:`.optimizer`: :class:`OffloadOptimizer`, the optimizer the engine and the schedule see
- :mod:`.steps`: :class:`OffloadSteps`, its answers to the engine's step protocol
- :mod:`.grads`: the gradient path down (copies, the host worker's sums, unscaling, norms)
- :mod:`.held_grads`: gradients that wait on the device; :mod:`.host_bytes`: the host memory counted
- :mod:`.bucket`, :mod:`.layout`: buckets of parameters and their host buffers
- :mod:`.host_grad_checks`, :mod:`.inner_optimizer`: the checks and the per-bucket torch optimizer
- :mod:`.background_updates`, :mod:`.wait_before_reads`, :mod:`.half_uploads`: updates that
  run on while the next forward starts, and weights that go up in half where exact
"""

from __future__ import annotations

from hybridtrain.runtime.offload.background_updates import in_background_update
from hybridtrain.runtime.offload.bucket import Bucket
from hybridtrain.runtime.offload.layout import twin_flow_blocks
from hybridtrain.runtime.offload.optimizer import OffloadOptimizer
from hybridtrain.runtime.offload.steps import OffloadSteps

__all__ = [
    "Bucket",
    "OffloadOptimizer",
    "OffloadSteps",
    "in_background_update",
    "twin_flow_blocks",
]
