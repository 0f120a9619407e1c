"""The peers of the offload benchmark, set up as their own experts run them, on our workload.

Each peer trains the same model, tokens per step, AdamW settings and clipping as our modes
(:class:`workload.Setup`), in the same process and run, and its row carries ``config``: the
exact settings, so the comparison can be audited. The choices, with their sources in
DeepSpeed 0.19.8:

- **Micro-batch × accumulation**: every peer takes the whole step as one micro-batch
  (accumulation 1, same tokens). ZeRO-Offload's fast path needs it: ``stage_1_and_2.py``
  ``copy_grads_in_partition`` calls ``async_accumulate_grad_in_cpu_via_gpu`` (each
  parameter's gradient copied to the host and back per micro-batch) whenever
  ``micro_step_id > 0`` or the micro-batch is not the boundary; with bf16 gradients the
  compact fp32 buffer that would avoid it is off (``_use_compact_grad_partition_buffer``
  needs ``grad_accum_dtype`` fp32 ≠ the model's dtype). FSDP2 then reduces once per step too.
- **Checkpointing**: off where the activations of the one big micro-batch fit (faster: no
  recomputation), every block (``torch.utils.checkpoint``, non-reentrant) where they do not
  (``Setup.peer_checkpointing``; the GPU check turns it on at 6.7B). The row says which.
- **ZeRO-Offload** (stage 2): ``offload_optimizer {cpu, pin_memory}``, ``overlap_comm``,
  ``contiguous_gradients``, ``reduce_scatter``, ``reduce_bucket_size`` 2e7 — the bucket our
  optimizer offload uses (Hugging Face's ``auto`` gives hidden² = 1.7e7 at 6.7B); DeepSpeed's
  CPU Adam (``zero_force_ds_cpu_optimizer`` default).
- **ZeRO-3 offload**: parameters and optimizer offloaded, pinned; ``stage3_prefetch_bucket_size``
  two blocks' parameters, ``stage3_max_live_parameters`` and ``stage3_max_reuse_distance`` three
  (the block running and the two prefetched), ``stage3_param_persistence_threshold``
  10 × d_model (Hugging Face's ``auto``: LayerNorms and biases stay on the device),
  ``sub_group_size`` 1e8 (the host step in ~0.4 GB groups instead of the 1e9 default).
- **ZeRO-3 SuperOffload**: the same with ``offload_optimizer.super_offload: true``
  (``runtime/zero/offload_config.py``; ``engine.py`` then builds ``SuperOffloadOptimizer_Stage3``,
  which asserts a CUDA accelerator: ``runtime/superoffload/superoffload_stage3.py``).
- **FSDP2**: ``fully_shard`` per block and at the root with ``CPUOffloadPolicy(pin_memory=True)``,
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, ``reshard_after_forward=False``
  (one rank: the bf16 weights stay on the device from forward to backward instead of being
  uploaded twice; they fit at 6.7B), explicit prefetch of the next block in forward and the
  previous one in backward, torch's fused AdamW on the host (all bound cores).
- **Host threads**: ``workload.bind_host_threads`` (``--bind-cores``), for every row alike.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import itertools
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from workload import (
    OFFLOAD_OPTIMIZER,
    OPTIMIZER,
    Result,
    Setup,
    build_model,
    single_process_group,
    time_steps,
)

from hybridtrain.models.gpt import causal_lm_loss, gpt_param_count

PEERS: dict[str, str] = {
    "fsdp2_cpu_offload": "layer_major",
    "deepspeed_zero_offload": "optimizer_offload",
    "deepspeed_zero3_offload": "layer_major",
    "deepspeed_super_offload": "layer_major",
}
"""Each peer and our mode doing the same job (its row's ratio)."""
REDUCE_BUCKET = 20_000_000
SUB_GROUP = 100_000_000
SUPER_OFFLOAD_NEEDS_CUDA = ("super_offload needs CUDA (deepspeed/runtime/superoffload/superoffload_stage3.py "
                            "asserts the accelerator is cuda)")


def block_params(setup: Setup) -> int:
    """Parameters of one transformer block of the workload's model."""
    return gpt_param_count(setup.depth(2).model) - gpt_param_count(setup.depth(1).model)


def peer_setup(setup: Setup) -> Setup:
    """The peers' micro-batching: the whole step as one micro-batch (same tokens per step)."""
    return Setup(setup.model, setup.batch * setup.accumulation, 1, setup.steps, setup.device, setup.peak_tflops,
                 setup.clip, setup.overlap, setup.warmup, setup.peer_checkpointing)


def zero_settings(setup: Setup, name: str) -> dict[str, Any]:
    """The ``zero_optimization`` section DeepSpeed peer ``name`` runs with."""
    zero: dict[str, Any] = {"stage": 2, "offload_optimizer": copy.deepcopy(OFFLOAD_OPTIMIZER), "overlap_comm": True,
                            "contiguous_gradients": True, "reduce_scatter": True,
                            "reduce_bucket_size": REDUCE_BUCKET, "allgather_bucket_size": REDUCE_BUCKET}
    if name == "deepspeed_zero_offload":
        return zero
    layer = block_params(setup)
    zero.update(stage=3, offload_param=copy.deepcopy(OFFLOAD_OPTIMIZER), stage3_prefetch_bucket_size=2 * layer,
                stage3_max_live_parameters=3 * layer, stage3_max_reuse_distance=3 * layer,
                stage3_param_persistence_threshold=10 * setup.model.d_model, sub_group_size=SUB_GROUP)
    del zero["allgather_bucket_size"]  # a stage-2 key
    if name == "deepspeed_super_offload":
        zero["offload_optimizer"]["super_offload"] = True
    return zero


def deepspeed_config(setup: Setup, name: str) -> dict[str, Any]:
    """The whole DeepSpeed config of peer ``name`` (its row's ``config``, less the binding)."""
    peer = peer_setup(setup)
    return peer.settings(zero_optimization=zero_settings(setup, name), steps_per_print=10**9,
                         wall_clock_breakdown=False)


def fsdp2_settings(setup: Setup) -> dict[str, Any]:
    """FSDP2's settings as its row records them."""
    cuda = setup.device == "cuda"
    peer = peer_setup(setup)
    return {"fully_shard": "every block and the root", "cpu_offload": {"pin_memory": cuda},
            "mixed_precision": {"param_dtype": "bfloat16" if cuda else None, "reduce_dtype": "float32"},
            "reshard_after_forward": False, "prefetch": {"forward": "next block", "backward": "previous block"},
            "optimizer": {"class": "torch.optim.AdamW", "fused": True, **OPTIMIZER["params"]},
            "micro_batch": peer.batch, "accumulation": peer.accumulation,
            "gradient_clipping": setup.clip or None}


def peer_config(setup: Setup, name: str) -> dict[str, Any]:
    """The exact settings peer ``name`` runs with, checkpointing included."""
    config = fsdp2_settings(setup) if name == "fsdp2_cpu_offload" else deepspeed_config(setup, name)
    return {**config, "activation_checkpointing": "every block (torch.utils.checkpoint, non-reentrant)"
            if setup.peer_checkpointing else "none"}


class CheckpointedBlock(nn.Module):
    """A block whose activations are recomputed in backward (what Hugging Face's
    ``gradient_checkpointing_enable`` does per layer), as one module FSDP2 and ZeRO-3 shard."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)  # type: ignore[no-any-return]


def build_peer_model(setup: Setup) -> nn.Module:
    """The workload's model, its blocks checkpointed where the peer runs so."""
    model = build_model(setup.model)
    if setup.peer_checkpointing:
        for index, block in enumerate(model.blocks):
            model.blocks[index] = CheckpointedBlock(block)
    return model


def measure_fsdp2(setup: Setup) -> Result:
    """FSDP2 with ``CPUOffloadPolicy`` as :func:`fsdp2_settings` says. The model is given in host
    memory: each ``fully_shard`` moves one unit to the device and its shards back, so the whole
    fp32 model is never on the device."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    single_process_group(setup.device)
    mesh = init_device_mesh(setup.device, (1,))
    peer = peer_setup(setup)
    model = build_peer_model(setup)
    cuda = setup.device == "cuda"
    settings = {"mesh": mesh, "reshard_after_forward": False, "offload_policy": CPUOffloadPolicy(pin_memory=cuda),
                "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cuda else None,
                                                  reduce_dtype=torch.float32)}
    blocks = list(model.blocks)
    for block in blocks:
        fully_shard(block, **settings)
    fully_shard(model, **settings)
    for earlier, later in itertools.pairwise(blocks):
        earlier.set_modules_to_forward_prefetch([later])  # type: ignore[operator]
        later.set_modules_to_backward_prefetch([earlier])  # type: ignore[operator]
    # fused: torch's fused CPU kernel on all bound threads, as our host step (the default
    # for-loop AdamW on CPU parameters is ~8x slower: that would measure the optimizer choice).
    optimizer = torch.optim.AdamW(model.parameters(), fused=True, **OPTIMIZER["params"])  # type: ignore[arg-type]
    micro_batches = peer.micro_batches()

    def step() -> None:
        for index, micro in enumerate(micro_batches):
            model.set_requires_gradient_sync(index == len(micro_batches) - 1)  # type: ignore[operator]
            (causal_lm_loss(model(micro[0]), micro) / len(micro_batches)).backward()
        if setup.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), setup.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return time_steps(setup, "fsdp2_cpu_offload", step, config=peer_config(setup, "fsdp2_cpu_offload"))


def measure_deepspeed(setup: Setup, name: str) -> Result:
    """DeepSpeed peer ``name`` with :func:`deepspeed_config`. Its AdamW with offload is
    DeepSpeedCPUAdam, an op built just in time (the GPU check builds it before the first timed
    part): a failed build is this row's status."""
    import deepspeed

    single_process_group(setup.device)
    peer = peer_setup(setup)
    model = build_peer_model(setup)
    config = deepspeed_config(setup, name)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    del model
    try:
        micro_batches = peer.micro_batches()

        def step() -> None:
            # engine.backward scales each loss by 1/gradient_accumulation_steps and engine.step
            # steps only at the boundary: the batch's mean loss, as in our engine.
            for micro in micro_batches:
                engine.backward(causal_lm_loss(engine(micro[0]), micro))
                engine.step()

        return time_steps(setup, name, step, config=peer_config(setup, name))
    finally:
        with contextlib.suppress(Exception):  # older versions lack it; never hide the step's error
            engine.destroy()  # ZeRO-3 keeps hooks on the module and parameters in coordinators


def peer_run(setup: Setup, name: str) -> Callable[[], Result] | str:
    """How to measure peer ``name``, or why it is skipped here."""
    if name == "fsdp2_cpu_offload":
        return functools.partial(measure_fsdp2, setup)
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed not installed"
    if setup.device != "cuda" and os.environ.get("DS_ACCELERATOR") != "cpu":
        return "on a CPU DeepSpeed runs with DS_ACCELERATOR=cpu (its CPU accelerator over gloo; the dry run sets it)"
    if name == "deepspeed_super_offload" and setup.device != "cuda":
        return SUPER_OFFLOAD_NEEDS_CUDA
    return functools.partial(measure_deepspeed, setup, name)
