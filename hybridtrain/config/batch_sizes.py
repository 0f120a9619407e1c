"""The batch arithmetic of a run: ``global = micro × accumulation × data_parallel``, the missing one of
the three sizes filled in or all three checked."""

from __future__ import annotations

from dataclasses import dataclass

from hybridtrain.config.loading import ConfigError
from hybridtrain.config.schema import Config


@dataclass(frozen=True)
class BatchSizes:
    """The batch arithmetic of one run: ``global = micro × accumulation × data_parallel``."""

    global_batch: int
    micro_batch: int
    accumulation_steps: int
    data_parallel: int


def resolve_batch_sizes(cfg: Config, data_parallel: int) -> BatchSizes:
    """Fill in the missing one of the three batch sizes, or check that all three agree.

    Args:
        cfg: the configuration.
        data_parallel: number of data-parallel replicas.

    Raises:
        ConfigError: inconsistent or indivisible sizes (the message lists all three).
    """
    total, micro, accum = (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    )
    shown = (
        f"train_batch_size={total}, train_micro_batch_size_per_gpu={micro}, "
        f"gradient_accumulation_steps={accum}, data-parallel size={data_parallel}"
    )
    if total is None:
        micro = micro or 1
        accum = accum or 1
        total = micro * accum * data_parallel
    elif micro is None:
        accum = accum or 1
        if total % (accum * data_parallel):
            raise ConfigError(
                f"batch sizes do not divide: {shown}; train_batch_size must be a multiple of "
                "gradient_accumulation_steps × data-parallel size"
            )
        micro = total // (accum * data_parallel)
    elif accum is None:
        if total % (micro * data_parallel):
            raise ConfigError(
                f"batch sizes do not divide: {shown}; train_batch_size must be a multiple of "
                "train_micro_batch_size_per_gpu × data-parallel size"
            )
        accum = total // (micro * data_parallel)
    if total != micro * accum * data_parallel:
        raise ConfigError(
            f"inconsistent batch sizes: {shown}; need train_batch_size = "
            "train_micro_batch_size_per_gpu × gradient_accumulation_steps × data-parallel size"
        )
    return BatchSizes(total, micro, accum, data_parallel)
