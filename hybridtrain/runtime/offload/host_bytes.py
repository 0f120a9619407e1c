"""Host bytes per parameter, counted from what the runtime actually allocated (not from a
formula): the planner's host model (:mod:`~hybridtrain.planner.memory`) is checked against
these figures, and a run can state its own.

Two kinds of host memory, kept apart because they scale differently:

- *persistent*: held for the whole run, proportional to the offloaded parameters — fp32
  masters, the optimizer's state (two fp32 moments for Adam), gradient buffers that wait in
  host memory (one per bucket, once a gradient had to wait there), half-width images of
  streamed blocks;
- *staging*: the pooled buffers gradients and half uploads pass through on their way —
  a few buffers of the largest bucket, independent of the model's size.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from hybridtrain.runtime.offload.bucket import Bucket
from hybridtrain.runtime.transfer import HostBufferPool


@dataclass(frozen=True)
class HostBytes:
    """Host memory the runtime allocated for offloaded parameters.

    Attributes:
        params: parameters (elements) whose master weights live in host memory.
        masters: bytes of their master weights.
        optimizer_state: bytes of the optimizer's state tensors in host memory.
        waiting_grads: bytes of lasting host gradient buffers (gradients that waited there).
        images: bytes of half-width images of streamed blocks (kept between uses).
        staging: bytes of pooled buffers (bounded, independent of the model's size).
    """

    params: int
    masters: int
    optimizer_state: int
    waiting_grads: int
    images: int
    staging: int

    @property
    def persistent(self) -> int:
        """Bytes held for the whole run, proportional to the offloaded parameters."""
        return self.masters + self.optimizer_state + self.waiting_grads + self.images

    @property
    def persistent_per_param(self) -> float:
        """:attr:`persistent` per offloaded parameter (12.0 for fp32 Adam with nothing waiting)."""
        return self.persistent / self.params if self.params else 0.0

    def with_images(self, images: int, staging: int = 0) -> HostBytes:
        """These bytes plus ``images`` bytes of half-width images kept per block and
        ``staging`` bytes of pooled ones."""
        return HostBytes(self.params, self.masters, self.optimizer_state, self.waiting_grads,
                         self.images + images, self.staging + staging)


def state_bytes(states: Iterable[dict[str, object]]) -> int:
    """Bytes of the host-memory tensors in optimizer states (Adam's moments and step counters)."""
    return sum(value.nbytes for state in states for value in state.values()
               if isinstance(value, torch.Tensor) and value.device.type == "cpu")


def offload_host_bytes(buckets: Sequence[Bucket], state: Mapping[torch.Tensor, dict[str, object]],
                       pool: HostBufferPool, half_staging: int) -> HostBytes:
    """What an :class:`~hybridtrain.runtime.offload.optimizer.OffloadOptimizer` allocated: its
    buckets' masters and lasting gradient buffers, the optimizer state of those masters, its
    gradient pool's buffers and ``half_staging`` bytes of half-upload staging."""
    return HostBytes(
        params=sum(b.flat_master.numel() for b in buckets),
        masters=sum(b.flat_master.nbytes for b in buckets),
        optimizer_state=state_bytes(state[m] for b in buckets for m in b.masters if m in state),
        waiting_grads=sum(b.flat_grad.nbytes for b in buckets if b.flat_grad is not None),
        images=0,
        staging=pool.allocated * pool.numel + half_staging,
    )
