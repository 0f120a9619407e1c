"""Turning one model into pipeline stages without rewriting its forward.

``torch.distributed.pipelining``'s tracer cannot split models whose forward does work
around the blocks with data-dependent Python (Hugging Face masks, rotary embeddings), so
stages are built from the block list instead. Every stage calls the model's own forward
on the micro-batch; a :class:`StageRouter` installed on the blocks makes that call compute
only the stage's part::

    model.forward(batch) on stage s, blocks [a, b):

      pre-work (embeddings, masks, position embeddings: cheap, recomputed on every stage)
        │
      blocks < a ........ pass the hidden state through untouched
      block a ........... input replaced by the activation received from stage s-1
      blocks a … b-1 .... run (the stage's own weights)
      block b-1 ......... not the last stage: its output leaves the forward (StageExit)
        │
      post-work (final norm, head) and the loss: last stage only

Blocks of other ranks are replaced by :class:`PassThroughBlock` (their weights freed), so a
rank holds its own blocks plus the modules outside the blocks. Side inputs the blocks get
from the pre-work (attention masks, rotary tables) are recomputed from the micro-batch:
the schedule hands every stage the micro-batch's index, and the stage reads the
micro-batch from the step's list (the engine's own split, which non-tensor leaves and
tensors without a batch dimension survive unchanged).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hybridtrain.models.usage import hidden_of
from hybridtrain.runtime.batch import Batch, LossFn, compute_loss, run_model


class StageExit(Exception):  # noqa: N818 (control flow, not an error)
    """Raised after a non-last stage's final block to leave the model's forward early."""

    def __init__(self, output: torch.Tensor) -> None:
        super().__init__("stage output")
        self.output = output


class PassThroughBlock(nn.Module):
    """Stands in for a block another rank runs: passes the hidden state through."""

    def __init__(self, tuple_output: bool) -> None:
        super().__init__()
        self.tuple_output = tuple_output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The hidden state, unchanged (as a 1-tuple where the real block returns tuples)."""
        hidden = hidden_of(args, kwargs)
        return (hidden,) if self.tuple_output else hidden


class StageRouter:
    """Routes one model forward through the stage that is running now.

    Args:
        blocks: the model's block container (blocks of other ranks are hollowed here).
        bounds: ``(start, stop)`` block range of every stage, in pipeline order.
        local: indices of the stages this rank runs.
        tuple_output: whether the blocks return tuples (hidden state first).
    """

    def __init__(self, blocks: nn.ModuleList | nn.Sequential, bounds: list[tuple[int, int]],
                 local: list[int], tuple_output: bool) -> None:
        self.bounds = bounds
        self.num_stages = len(bounds)
        self.tuple_output = tuple_output
        self._current: int | None = None
        self._incoming: torch.Tensor | None = None
        mine = {i for s in local for i in range(*bounds[s])}
        for i in range(len(blocks)):
            if i in mine:
                block = blocks[i]
                block.forward = self._dispatch(i, block.forward)
            else:
                blocks[i] = PassThroughBlock(tuple_output)

    def run(self, stage: int, incoming: torch.Tensor | None, forward: Callable[[], Any]) -> Any:
        """Call ``forward`` (the model's forward) as stage ``stage`` with input ``incoming``.

        Returns:
            The stage's output activation, or the model's output on the last stage.
        """
        self._current, self._incoming = stage, incoming
        try:
            return forward()
        except StageExit as done:
            return done.output
        finally:
            self._current, self._incoming = None, None

    def _dispatch(self, index: int, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if self._current is None:
                raise RuntimeError("a pipelined model runs through engine.train_batch/eval_batch, not directly")
            start, stop = self.bounds[self._current]
            if not start <= index < stop:
                hidden = hidden_of(args, kwargs)
                return (hidden,) if self.tuple_output else hidden
            if index == start and self._incoming is not None:
                args, kwargs = _with_hidden(args, kwargs, self._incoming)
            return original(*args, **kwargs)
        return forward

    def install_exits(self, blocks: nn.ModuleList | nn.Sequential) -> None:
        """Make a non-last stage leave the model's forward after its last block.

        Installed as forward hooks after any ZeRO sharding of the blocks, so they run after
        FSDP2's post-forward hook (which reshards and arms the block's backward) instead of
        cutting it off.
        """
        for index, block in enumerate(blocks):
            if not isinstance(block, PassThroughBlock):
                block.register_forward_hook(self._exit_hook(index))

    def _exit_hook(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            current = self._current
            if current is not None and current < self.num_stages - 1 and index == self.bounds[current][1] - 1:
                raise StageExit(out[0] if isinstance(out, tuple) else out)
        return hook


def _with_hidden(args: tuple[Any, ...], kwargs: dict[str, Any],
                 hidden: torch.Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


class StageModule(nn.Module):
    """One pipeline stage as ``torch.distributed.pipelining.PipelineStage`` wants it:
    ``forward(*activations, index=micro_batch_index)``.

    Its registered parameters are only the stage's own (its blocks, plus the parameters
    outside the blocks that this stage's code uses), so the schedule's per-stage gradient
    handling (zero bubble's weight-gradient pass) touches nothing of other stages; the
    whole model is held unregistered.

    Args:
        model: the whole (hollowed) model.
        router: the router installed on its blocks.
        index: this stage's index in the pipeline.
        owned: the parameters this stage trains.
        loss_fn: the engine's loss function (last stage).
        weight: factor on each micro-batch's loss (1 / micro-batches).

    Attributes:
        batches: the micro-batches of the step being run (set before each schedule call).
        losses: the last stage's unweighted micro-batch losses of that step.
    """

    _model: nn.Module

    def __init__(self, model: nn.Module, router: StageRouter, index: int, owned: list[nn.Parameter],
                 loss_fn: LossFn | None, weight: float) -> None:
        super().__init__()
        object.__setattr__(self, "_model", model)
        self.router = router
        self.index = index
        self.owned = nn.ParameterList(owned)
        self.loss_fn = loss_fn
        self.weight = weight
        self.is_last = index == router.num_stages - 1
        self.batches: list[Batch] = []
        self.losses: list[torch.Tensor] = []

    def forward(self, *activations: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The stage's output activation, or ``[loss × weight]`` on the last stage."""
        batch = self.batches[int(index.item())]
        incoming = activations[0] if activations else None
        out: torch.Tensor = self.router.run(self.index, incoming, lambda: run_model(self._model, batch))
        if not self.is_last:
            return out
        loss = compute_loss(out, batch, self.loss_fn).float()
        self.losses.append(loss.detach())
        # One element rather than a scalar: the schedule concatenates the last stage's
        # outputs (evaluation), which 0-d tensors do not allow.
        return (loss * self.weight).reshape(1)
