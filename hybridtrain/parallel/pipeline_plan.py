"""How the blocks are split into pipeline stages, as a frozen value: the pipeline's part of
a :class:`~hybridtrain.plan.types.TrainingPlan`, beside the pipeline that reads it."""

from __future__ import annotations

from dataclasses import dataclass

from hybridtrain.models.usage import ModelUsage


@dataclass(frozen=True)
class PipelinePlan:
    """How the blocks are split into pipeline stages.

    Attributes:
        schedule: ``gpipe`` | ``1f1b`` | ``interleaved_1f1b`` | ``zero_bubble``.
        micro_batches: micro-batches per step.
        virtual_stages: stages per rank.
        partition: the rule (``time`` | ``params`` | ``uniform``) or block counts.
        counts: blocks per stage, or None when ``partition: time`` measures them at build.
        blocks_path: dotted path of the block container.
        usage: where the example micro-batch's forward used each parameter.
    """

    schedule: str
    micro_batches: int
    virtual_stages: int
    partition: str | tuple[int, ...]
    counts: tuple[int, ...] | None
    blocks_path: str
    usage: ModelUsage
