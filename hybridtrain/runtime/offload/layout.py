"""How optimizer offload lays parameters out: which stay on the device (twin-flow), the
buckets they travel in, the host masters' type, and the host memory all of it needs
(checked before anything is allocated). Pure functions over parameter lists."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from hybridtrain.optim import optimizer_state_bytes
from hybridtrain.runtime import transfer


def device_kept(params: list[nn.Parameter], host_ratio: float, streamed: set[int], first: bool = False) -> set[int]:
    """Twin-flow: ``1 - host_ratio`` of all the elements stay on the device, none of the
    ``streamed`` (layer streaming makes the blocks holding them resident first,
    :func:`twin_flow_blocks`, so they are the same parameters). Which ones: the last
    parameters (DeepSpeed's choice), or with ``first`` the first ones.

    Why the first can pay: a deferred host step (clipping, fp16 checks) hides behind the next
    forward, which reads the parameters in order. With the device share first, that forward
    runs through it at once while the host updates the rest; with it last, the forward waits
    for every host update before reaching it, and its part of the forward hides nothing.
    Why the last can pay under streaming: backward frees the resident blocks' activations
    first, before the gradients held on the device have grown."""
    candidates = [p for p in params if id(p) not in streamed]
    budget = (1.0 - host_ratio) * sum(p.numel() for p in params)
    kept: set[int] = set()
    for p in candidates if first else reversed(candidates):
        if budget <= 0:
            break
        kept.add(id(p))
        budget -= p.numel()
    return kept


def twin_flow_blocks(blocks: Sequence[tuple[str, nn.Module]], params: list[nn.Parameter],
                     host_ratio: float, first: bool = False) -> list[str]:
    """The blocks (``(name, module)``) holding a parameter Twin-Flow keeps on the device at
    ``host_ratio`` (:func:`device_kept` over ``params``): under layer streaming they stay
    resident, their update and state on the device."""
    kept = device_kept(params, host_ratio, set(), first)
    return [name for name, module in blocks if any(id(p) in kept for p in module.parameters())]


def least_streaming_ratio(blocks: Sequence[nn.Module], params: list[nn.Parameter], first: bool = False) -> float:
    """The smallest Twin-Flow ``host_ratio`` at which the device share (:func:`device_kept`)
    leaves one of ``blocks`` wholly on the host, so layer streaming has a block to stream:
    the share (the last parameters, or the first) must end short of that block's parameters."""
    position = {id(p): i for i, p in enumerate(params)}
    sizes = [p.numel() for p in params]
    total = sum(sizes)
    room = 0  # elements the share may take without touching some block
    for block in blocks:
        where = [position[id(p)] for p in block.parameters() if id(p) in position]
        if where:
            room = max(room, sum(sizes[:min(where)]) if first else sum(sizes[max(where) + 1:]))
    return 1.0 - room / total if total else 1.0


def master_dtype(param: torch.Tensor) -> torch.dtype:
    """The host master's type: fp64 for an fp64 parameter (an fp64 model trains in fp64, as
    the plain loop does), fp32 for every other (mixed precision's fp32 masters; fp8 too)."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def bucket_dtype(params: list[nn.Parameter]) -> torch.dtype:
    dtypes = {master_dtype(p) for p in params}
    if len(dtypes) > 1:
        raise ValueError(f"a streamed block's parameters need one master type, found {sorted(map(str, dtypes))}: "
                         "give the block's parameters one dtype")
    return dtypes.pop() if dtypes else torch.float32


def chunks(params: list[nn.Parameter], numel: int) -> Iterable[list[nn.Parameter]]:
    """Runs of ``params`` of about ``numel`` elements, each of one master type."""
    chunk: list[nn.Parameter] = []
    size = 0
    for p in params:
        if chunk and (size + p.numel() > numel or master_dtype(p) != master_dtype(chunk[0])):
            yield chunk
            chunk, size = [], 0
        chunk.append(p)
        size += p.numel()
    if chunk:
        yield chunk


POOLED_BUFFERS = 3
"""Host buffers gradients pass through: one being copied down, one stepped with, one spare."""


def host_state_bytes(numel: int, optimizer: torch.optim.Optimizer, grads_wait_on_host: bool = True) -> int:
    """Host bytes for ``numel`` offloaded elements: the fp32 master, the fp32 gradient when
    gradients wait in host memory, and the optimizer's per-element state (two fp32 moments
    for the Adam family)."""
    state = optimizer_state_bytes(type(optimizer).__name__, optimizer.defaults)
    return numel * (4 + (4 if grads_wait_on_host else 0) + state)


def check_host_memory(params: list[nn.Parameter], on_device: set[int], optimizer: torch.optim.Optimizer,
                       grads_wait_on_host: bool, pool_bytes: int) -> None:
    # in fp32 elements: an fp64 master, its gradient and state take twice the bytes
    numel = sum(p.numel() * master_dtype(p).itemsize // 4 for p in params if id(p) not in on_device)
    cpu_resident = sum(p.numel() * p.element_size() for p in params if p.device.type == "cpu")
    # Parameters already in host memory (CPU device, streamed blocks) are replaced, not added to.
    needed = host_state_bytes(numel, optimizer, grads_wait_on_host) + min(pool_bytes, 4 * numel) - cpu_resident
    transfer.check_host_memory(needed, "optimizer offload")


DEVICE_SHARE_GROUP_NUMEL = 100_000_000
"""Elements of the device share (Twin-Flow) one update group holds at most (or one parameter,
if larger): torch's foreach AdamW makes a temporary of its group's size (400 MB in fp32), not of
the whole share's, so held gradients can still be on the device while it steps."""


def device_share_groups(params: list[nn.Parameter], numel: int) -> list[list[nn.Parameter]]:
    """The device share's parameters (in the model's order: the next forward's) in runs of at
    most ``numel`` elements (one larger parameter alone), each of one master type."""
    return list(chunks(params, numel))
