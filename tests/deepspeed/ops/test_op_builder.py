"""``deepspeed.ops``' op builders and ``__compatible_ops__`` under the drop-in (what
transformers' DeepSpeed tests import to decide what to skip), and DeepSpeed's "DeepSpeed
info" log line at ``initialize``."""

from __future__ import annotations

import logging

import pytest
import torch

import hybridtrain.deepspeed as deepspeed
from hybridtrain.deepspeed.ops import op_builder
from hybridtrain.deepspeed.ops.aio import AsyncIOBuilder
from hybridtrain.deepspeed.utils import logger


def test_compatible_ops_report_what_the_dropin_provides_and_nothing_is_built() -> None:
    compatible = deepspeed.ops.__compatible_ops__
    assert compatible[AsyncIOBuilder.NAME] is False  # transformers' require_deepspeed_aio skips then
    assert {name for name, ok in compatible.items() if ok} == {"cpu_adam", "fused_adam"}
    assert set(compatible) == set(op_builder.ALL_OPS)
    assert op_builder.CPUAdamBuilder().is_compatible() and not AsyncIOBuilder().is_compatible()
    with pytest.raises(NotImplementedError, match="op 'async_io' is not built by hybridtrain's DeepSpeed drop-in$"):
        AsyncIOBuilder().load()
    with pytest.raises(NotImplementedError, match="deepspeed.ops.adam provides its optimizer"):
        op_builder.CPUAdamBuilder().load()


def test_initialize_logs_deepspeeds_info_line() -> None:
    """The line users and transformers' tests read from DeepSpeed's logger."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)  # its default; importing the real DeepSpeed in-process sets WARNING
    try:
        deepspeed.initialize(model=torch.nn.Linear(2, 2), config={"train_micro_batch_size_per_gpu": 1,
                                                                   "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert any("DeepSpeed info: version=0.19.8+hybridtrain" in r.getMessage() for r in records)
