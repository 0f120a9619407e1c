"""Settings that load but cannot run here are refused before any work, naming the key."""

from __future__ import annotations

import pytest

from hybridtrain.config import ConfigError, load_config
from hybridtrain.plan.checks import check_supported


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"tensor_model_parallel_size": 2}, "multiple of 2"),
        ({"zero_optimization": {"offload_param": {"device": "nvme"}}}, "offload_param.device"),
        ({"layer_streaming": {"enabled": True},
          "activation_checkpointing": {"enabled": True, "module_classes": ["Block"]}}, "allowed: module_classes"),
    ],
)
def test_unsupported_settings_are_named(raw: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        check_supported(load_config(raw), world_size=1)


def test_defaults_are_supported() -> None:
    check_supported(load_config({}), world_size=1)


def test_pipeline_micro_batches_implied_by_the_batch_sizes_count() -> None:
    # train_batch_size 4 of micro-batches of 2 on one replica = 2 micro-batches: enough for 2 stages.
    implied = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
               "pipeline": {"stages": 2, "schedule": "gpipe"}}
    check_supported(load_config(implied), world_size=2)
    with pytest.raises(ConfigError, match=r"micro_batches=1, stages=2"):
        check_supported(load_config({**implied, "train_batch_size": 2}), world_size=2)
