"""What the engine asks of "the other processes", as one small protocol.

The engine is written once, for one process; everything that changes when several
processes cooperate goes through a :class:`ParallelRuntime`:

- ``module``: what the forward pass calls (the user's model, or its DDP wrapper);
- ``set_grad_sync(flag)``: called before each micro-batch's forward — False inside
  gradient accumulation, so gradients are communicated once per optimizer step;
- ``mean_loss(value)``: turn this rank's loss into the global batch's mean loss, the same
  number on every rank;
- ``clip_grad_norm`` / ``all_finite``: gradient checks that must see every rank's shard;
- the ``*_state_dict`` methods: full (unsharded) states for users and checkpoints, and
  ``is_writer`` to let one rank write them; ``owns`` / ``row_interleave`` /
  ``from_user_layout``: how this rank's tensors map to a checkpoint's full entries.

Three implementations, chosen by the plan's ``replication``:
:class:`~hybridtrain.parallel.replicated.ReplicatedRuntime` (every rank holds the whole
model: one process, the engine's default, or DDP),
:class:`~hybridtrain.parallel.zero.ZeroRuntime` (ZeRO: FSDP2 shards) and
:class:`~hybridtrain.parallel.split.SplitRuntime` (tensor and/or pipeline parallel).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import nn

from hybridtrain.parallel.mesh import Topology


class ParallelRuntime(Protocol):
    """The engine's view of the other processes (see the module docstring)."""

    model: nn.Module
    """The user's model (parameter names as the user knows them)."""
    topology: Topology
    """Where this rank sits."""
    module: nn.Module
    """What the forward calls."""

    @property
    def distributed(self) -> bool:
        """Whether more than one process cooperates."""

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes shared files (checkpoints, metrics)."""

    def set_grad_sync(self, sync: bool) -> None:
        """Communicate gradients in the next backward (False while accumulating)."""

    def counts_loss(self) -> bool:
        """Whether this rank's loss counts in the global mean (one rank per replica)."""

    def mean_loss(self, value: torch.Tensor) -> torch.Tensor:
        """The global batch's mean loss from this rank's replica mean, on every rank."""

    def all_finite(self, finite: bool) -> bool:
        """Whether every rank found its gradients finite."""

    def clip_grad_norm(self, params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip by the whole model's gradient norm; returns the norm before clipping."""

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's full state dict as CPU copies (every rank gets it)."""

    def model_state_shapes(self) -> dict[str, torch.Size]:
        """Full shape of every state-dict entry."""

    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full state dict on every rank."""

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's full state."""

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Restore :meth:`optimizer_state_dict`'s result on every rank."""

    def owns(self, name: str) -> bool:
        """Whether this rank saves the state-dict entry (or parameter) ``name``."""

    def row_interleave(self, name: str) -> int:
        """The fused-qkv row order of ``name``'s tensors here (1 = the user's)."""

    def from_user_layout(self, name: str, full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``full``, a whole entry in the user's row order, in ``like``'s layout."""

    def barrier(self) -> None:
        """Wait for every rank."""
