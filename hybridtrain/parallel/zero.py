"""ZeRO stages 1-3 on FSDP2 (``fully_shard``) over the data-parallel mesh dimension.

Each block is its own FSDP unit (its parameters are gathered just before it runs), the
root unit holds what lives outside the blocks (embeddings, final norm, head — tied
weights included, since both users are in the root). What each stage keeps sharded::

    stage  optimizer states  gradients               parameters between uses
    1      sharded           full during accumulation  full  (reshard_after_forward=False)
    2      sharded           sharded                   full  (reshard_after_forward=False)
    3      sharded           sharded                   sharded (reshard_after_forward=True)

FSDP2 has no stage 1 of its own; it is built from its parts: parameters are not
resharded after forward, and gradient reduce-scatter is switched off
(``set_requires_gradient_sync(False)``) for every micro-batch but the last, so each rank
accumulates full, local gradients and communicates once per optimizer step — ZeRO-1's
trade (more gradient memory, less traffic). The optimizer always steps on the shards, so
its states are 1/N per rank in every stage.

Offload (``offload_param`` / ``offload_optimizer`` = ``cpu``) uses FSDP2's
``CPUOffloadPolicy``: sharded parameters, their gradients and the optimizer step live in
host memory and each unit's parameters are copied to the device when gathered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from hybridtrain.parallel.gradient_sync import full_tensor
from hybridtrain.parallel.mesh import Topology
from hybridtrain.parallel.replicated import ReplicatedRuntime


def apply_zero(model: nn.Module, blocks: Sequence[nn.Module], mesh: DeviceMesh | None, stage: int,
               param_dtype: torch.dtype | None = None, offload: bool = False) -> None:
    """Shard ``model`` in place for ZeRO ``stage`` (1, 2 or 3).

    Args:
        model: the model, on its device (its parameters become DTensor shards).
        blocks: the repeated blocks; each becomes its own FSDP unit.
        mesh: the one-dimensional data-parallel mesh.
        stage: 1, 2 or 3 (see the module docstring).
        param_dtype: dtype parameters are gathered in for compute (bf16/fp16 mixed
            precision); gradients are still reduced in fp32.
        offload: keep shards, gradients and optimizer step in host memory.

    Raises:
        ValueError: a stage outside 1-3.
    """
    if stage not in (1, 2, 3):
        raise ValueError(f"zero_optimization.stage = {stage}; apply_zero handles 1, 2 or 3")
    mixed = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    policy: OffloadPolicy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    reshard = stage == 3
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mixed, offload_policy=policy)
    # The root's parameters are used first (embeddings) and last (head), so keeping them
    # gathered through the step costs little and saves an all-gather.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mixed, offload_policy=policy)


class ZeroRuntime(ReplicatedRuntime):
    """The :class:`~hybridtrain.parallel.runtime.ParallelRuntime` of a ZeRO-sharded model: full states are
    gathered on demand.

    Args:
        model: the sharded model (after :func:`apply_zero`); also what the forward calls.
        topology: where this rank sits.
        stage: the ZeRO stage (1 defers gradient communication to the last micro-batch).
    """

    def __init__(self, model: nn.Module, topology: Topology, stage: int) -> None:
        super().__init__(model, topology)
        self.stage = stage

    def set_grad_sync(self, sync: bool) -> None:
        """Stage 1 keeps full local gradients until the last micro-batch; 2/3 always reduce."""
        if self.stage == 1:
            set_fsdp_grad_sync(self.model, sync)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unsharded state dict on every rank (an all-gather per tensor)."""
        return {k: full_tensor(v).detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full state dict; every rank keeps only its shards."""
        set_model_state_dict(self.model, dict(state.items()),
                             options=StateDictOptions(full_state_dict=True))

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The full optimizer state keyed by parameter name (gathered; complete on rank 0)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(self.model, optimizer, options=options)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Restore a full optimizer state (as saved by :meth:`optimizer_state_dict`) into shards."""
        set_optimizer_state_dict(self.model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def set_fsdp_grad_sync(model: nn.Module, sync: bool) -> None:
    """Whether an FSDP2-sharded model reduce-scatters gradients in the next backward (ZeRO-1
    keeps full local gradients until the last micro-batch)."""
    model.set_requires_gradient_sync(sync)  # type: ignore[operator]
