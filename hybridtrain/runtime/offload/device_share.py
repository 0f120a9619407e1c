"""The device share's update (Twin-Flow, ``offload_optimizer.ratio`` below 1) group by group.

Torch's foreach AdamW (CUDA's default kernel) makes temporaries the size of everything it
steps at once (``exp_avg_sq``'s square root, 10.3 GiB over GPT-13B's share). Stepped in runs
of at most :data:`~hybridtrain.runtime.offload.layout.DEVICE_SHARE_GROUP_NUMEL` elements, in
the model's order (the next forward's), the temporary is one run's, so the update can meet
every held gradient still waiting to land (:func:`~hybridtrain.runtime.offload.held_grads.land_held_later`).

The same bits as one update over the whole share: every foreach (and single-tensor) AdamW
operation is elementwise within one tensor, its scalars (step, bias corrections, learning
rate) are per parameter or per group, and the groups keep the outer optimizer's
hyperparameters and share its state (``tests/runtime/offload/test_device_share.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from hybridtrain.runtime.offload import layout
from hybridtrain.runtime.offload.inner_optimizer import inner_optimizer, sync_hyperparams


class DeviceShareUpdate:
    """The device share's optimizer, one inner optimizer per bounded run of parameters.

    Args:
        cls: the user's optimizer class.
        outer: the optimizer whose groups (hyperparameters) and state the runs follow.
        params: the device share's parameters, in the model's order.
        group_index: each parameter's group in ``outer``, by ``id``.
        numel: elements one run holds at most (a larger parameter runs alone); None:
            :data:`~hybridtrain.runtime.offload.layout.DEVICE_SHARE_GROUP_NUMEL`.
    """

    def __init__(self, cls: Callable[..., torch.optim.Optimizer], outer: torch.optim.Optimizer,
                 params: list[nn.Parameter], group_index: Mapping[int, int],
                 numel: int | None = None) -> None:
        bound = layout.DEVICE_SHARE_GROUP_NUMEL if numel is None else numel  # read now: tests lower it
        self.runs = [inner_optimizer(cls, outer, [run], [[group_index[id(p)] for p in run]], fused=False)
                     for run in layout.device_share_groups(params, bound)]
        self._outer = outer

    @property
    def state(self) -> Any:
        """The state the runs share (the outer optimizer's)."""
        return self._outer.state

    @state.setter
    def state(self, state: Any) -> None:
        for run in self.runs:
            run.state = state

    def step(self) -> None:
        """Update every run in turn with the outer optimizer's current hyperparameters; each
        run's temporaries are freed before the next one's are made."""
        for run in self.runs:
            sync_hyperparams(run, self._outer)
            run.step()
