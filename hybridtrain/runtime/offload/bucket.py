"""A bucket of the host optimizer (:mod:`~hybridtrain.runtime.offload.optimizer`): the
parameters whose gradients travel and whose update runs together, their host masters
and gradient buffer, and where each parameter lies in them."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from torch import nn

from hybridtrain.compat import unscale_and_check_
from hybridtrain.runtime import transfer
from hybridtrain.runtime.offload.layout import bucket_dtype
from hybridtrain.runtime.precision.scaling import found_inf_flag


@dataclass(eq=False)
class Bucket:
    """Parameters whose gradients travel and whose update runs together.

    ``params`` are the tensors autograd fills; ``masters`` the host tensors the optimizer
    updates. For a streamed block they are the same objects (the parameter's data *is*
    the host master between uses), otherwise separate host copies. ``flat_grad`` exists
    once gradients had to wait in host memory (see :mod:`~hybridtrain.runtime.offload.optimizer`).
    """

    index: int
    params: list[nn.Parameter]
    masters: list[nn.Parameter]
    flat_master: torch.Tensor
    streamed: bool
    flat_grad: torch.Tensor | None = None
    optimizer: torch.optim.Optimizer | None = None
    group_of: list[int] = field(default_factory=list)
    has_grad: list[bool] = field(default_factory=list)
    arrived: int = 0
    hooked: int = 0
    """Parameters whose gradient hooks land the bucket (those trained when it was built)."""
    stepped: bool = False
    copied: torch.cuda.Event | None = None
    """The last gradient copy to the host; it ran after every kernel that read the bucket."""
    uploaded: torch.cuda.Event | None = None
    update: Future[None] | None = None
    """The bucket's background update (see :attr:`OffloadOptimizer.background`), until the
    optimizer has seen it finish."""
    norms: list[torch.Tensor | None] | None = None
    """Each gradient's 2-norm, taken on the host worker as the step's last landing of the
    bucket completed it (``grad_norms``); None where it was not (then taken at clipping)."""
    relands: list[bool] = field(default_factory=list)
    """Gradients seen landing twice in one backward (a parameter shared by parts that run
    a backward of their own): their sum may still grow at a landing, so never unscaled then."""
    landed_now: list[bool] = field(default_factory=list)
    """Which gradients landed in the current backward."""
    unscaled: list[bool] = field(default_factory=list)
    """Which gradients the host worker unscaled (fp16 loss scaling) as the step's final
    backward landed them; the rest are unscaled on the calling thread."""
    found_inf: torch.Tensor | None = None
    """Set to 1 when a gradient :meth:`unscale` unscaled was inf or NaN (None: none was)."""
    held: list[torch.Tensor | None] = field(default_factory=list)
    """Gradients waiting on the device (:mod:`~hybridtrain.runtime.offload.held_grads`)."""
    _offsets: list[int] = field(default_factory=list)

    @property
    def numel(self) -> int:
        """Elements of the bucket's parameters together."""
        return self.flat_master.numel()

    @property
    def trained(self) -> list[nn.Parameter]:
        """The parameters that get gradients (frozen ones, ``requires_grad`` False, as
        Marian's sinusoidal positions or a fine-tune's embeddings, never do)."""
        return [p for p in self.params if p.requires_grad]

    @classmethod
    def create(cls, index: int, params: list[nn.Parameter], streamed: bool, group_index: dict[int, int],
               pin_memory: bool, device: torch.device) -> Bucket:
        """Bucket ``index`` of ``params``: their values copied into one host master buffer
        (``group_index``: each parameter's optimizer group). A streamed bucket's
        parameters point at the masters (no second copy); otherwise the masters are new
        host parameters."""
        flat_master = transfer.host_buffer(sum(p.numel() for p in params), bucket_dtype(params), pin_memory, device)
        bucket = cls(index, params, [], flat_master, streamed, group_of=[group_index[id(p)] for p in params],
                     has_grad=[False] * len(params), relands=[False] * len(params),
                     landed_now=[False] * len(params), unscaled=[False] * len(params), held=[None] * len(params))
        for p, view in zip(params, bucket.views(flat_master), strict=True):
            view.copy_(p.detach())
            if streamed:
                p.data = view
                bucket.masters.append(p)
            else:
                bucket.masters.append(nn.Parameter(view, requires_grad=p.requires_grad))  # frozen stays frozen
        return bucket

    @property
    def has_work(self) -> bool:
        """Whether an update would change anything: a gradient landed, or one was put on a
        master directly (DeepSpeed's fp16 init step gives every parameter a zero one)."""
        return any(self.has_grad) or self.has_held or any(m.grad is not None for m in self.masters)

    @property
    def has_held(self) -> bool:
        """Whether gradients of this step wait on the device."""
        return any(g is not None for g in self.held)

    def take_held(self) -> list[torch.Tensor | None]:
        """The gradients waiting on the device, no longer held here."""
        held, self.held = self.held, [None] * len(self.params)
        return held

    def expose_grads(self, grads: list[torch.Tensor] | None = None) -> None:
        """Put the step's gradients (``grads``, else the lasting buffer's) on the masters:
        only once they are complete — a streamed block's master *is* its parameter, which
        holds device gradients again in the next micro-batch."""
        if grads is None:
            if self.flat_grad is None:
                return
            grads = self.views(self.flat_grad)
        for master, grad, has in zip(self.masters, grads, self.has_grad, strict=True):
            if has:
                master.grad = grad

    @property
    def unfinished_update(self) -> Future[None] | None:
        """:attr:`update` while it runs or if it failed (an upload must wait for it), else None."""
        update = self.update
        if update is not None and update.done() and update.exception() is None:
            return None
        return update

    def norm(self, j: int) -> torch.Tensor:
        """Parameter ``j``'s gradient 2-norm: the one :meth:`take_norms` took, else taken now
        from the gradient on its master (the same kernel, so the same bits)."""
        taken = self.norms[j] if self.norms is not None else None
        if taken is not None:
            return taken
        grad = self.masters[j].grad
        assert grad is not None
        return torch.linalg.vector_norm(grad, 2.0)

    def begin_backward(self) -> None:
        """A backward starts: no gradient has arrived or landed in it yet."""
        self.arrived = 0
        self.landed_now = [False] * len(self.params)

    def record_arrival(self, j: int) -> None:
        """Gradient ``j`` lands (on the calling thread, in order): learn whether it lands twice in one backward."""
        if self.landed_now[j]:
            self.relands[j] = True
        self.landed_now[j] = True

    def release(self) -> None:
        """Drop the host state (masters, gradient buffer, inner optimizer): the optimizer closes."""
        self.masters.clear()
        self.flat_master = torch.empty(0, dtype=self.flat_master.dtype)
        self.flat_grad = None
        self.optimizer = None
        self.held = [None] * len(self.params)

    def clear(self) -> None:
        """Forget the step's gradients (host and device) and that it stepped."""
        self.has_grad = [False] * len(self.params)
        self.unscaled = [False] * len(self.params)
        self.found_inf = None
        self.stepped = False
        self.norms = None
        self.held = [None] * len(self.params)
        for p in self.params:
            p.grad = None
        for m in self.masters:
            m.grad = None

    def take_norms(self, scaled: bool = False) -> None:
        """Each waiting gradient's 2-norm into :attr:`norms`: the kernel
        ``torch.nn.utils.get_total_norm`` runs per host tensor, so the same bits.
        ``scaled``: the gradients are loss-scaled; only those :meth:`unscale` unscaled
        have the norm clipping needs (the others' are taken after their unscale)."""
        assert self.flat_grad is not None
        self.norms = [torch.linalg.vector_norm(g, 2.0) if has and (done or not scaled) else None
                      for g, has, done in zip(self.views(self.flat_grad), self.has_grad, self.unscaled, strict=True)]

    def unscale(self, slots: Sequence[int], inv_scale: torch.Tensor) -> None:
        """Multiply the waiting gradients ``slots`` by ``inv_scale`` in place and raise
        :attr:`found_inf` if one is inf or NaN: the kernel and the factor of
        :meth:`LossScaler.unscale_and_check <hybridtrain.runtime.precision.scaling.LossScaler.unscale_and_check>`
        (elementwise, so one call per bucket gives the bits one call over all gives).
        Each gradient once per step: a sum that may still grow would be unscaled twice."""
        assert self.flat_grad is not None
        if any(self.unscaled[j] for j in slots):
            # Not seen in an earlier backward (those are never unscaled at a landing, see
            # ``relands``): the unscaled part and the new one cannot be summed exactly.
            raise RuntimeError(f"a gradient of host optimizer bucket {self.index} landed again in the step's last "
                               "backward after the host worker had unscaled it (a parameter whose gradient arrives "
                               "in pieces, which no earlier backward showed); this step is lost, later steps "
                               "unscale that gradient after backward")
        if not slots:
            return
        if self.found_inf is None:
            self.found_inf = found_inf_flag(self.flat_grad.device)
        grads = self.views(self.flat_grad)
        unscale_and_check_([grads[j] for j in slots], self.found_inf, inv_scale)
        for j in slots:
            self.unscaled[j] = True

    def staged(self, through: torch.Tensor,
               landed: Sequence[tuple[int, bool, torch.dtype | None]]) -> list[torch.Tensor]:
        """The gradients of a landing in the pooled buffer ``through``: :meth:`slots` with each
        landed one's type (``landed``: ``(j, first, dtype)``, dtype None: the master's)."""
        dtypes = [self.flat_master.dtype] * len(self.params)
        for j, _, dtype in landed:
            dtypes[j] = dtype or self.flat_master.dtype
        return self.slots(through, dtypes)

    def sum_staged(self, through: torch.Tensor, landed: Sequence[tuple[int, bool, torch.dtype | None]]) -> None:
        """Add a landing's gradients waiting in ``through`` (:meth:`staged`) into the lasting
        buffer (a step's first one is copied); those with dtype None went there directly."""
        assert self.flat_grad is not None
        staged, grads = self.staged(through, landed), self.views(self.flat_grad)
        for j, first, dtype in landed:
            if dtype is None:
                continue
            if first:
                grads[j].copy_(staged[j])
            else:
                # Same order as the plain loop's accumulation: earlier micro-batches + this
                # one, in the master's type (a half addend is widened exactly).
                grads[j].add_(staged[j])

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` cut into tensors shaped like the bucket's parameters."""
        out, offset = [], 0
        for p in self.params:
            out.append(flat[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        return out

    def slots(self, flat: torch.Tensor, dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
        """``flat`` (bytes laid out as :meth:`views` of the master type) cut into one tensor
        per parameter, at the start of its master's slot, of type ``dtypes[j]`` (no wider
        than the master type): half gradients land in the slots fp32 ones would."""
        return [self.slot(flat, j, dtype) for j, dtype in enumerate(dtypes)]

    def slot(self, flat: torch.Tensor, j: int, dtype: torch.dtype) -> torch.Tensor:
        """Parameter ``j``'s tensor of :meth:`slots` alone."""
        if len(self._offsets) != len(self.params):
            self._offsets = [0]
            for p in self.params[:-1]:
                self._offsets.append(self._offsets[-1] + p.numel())
        start = self._offsets[j] * self.flat_master.itemsize
        p = self.params[j]
        return flat.view(torch.uint8)[start:start + p.numel() * dtype.itemsize].view(dtype).view(p.shape)
