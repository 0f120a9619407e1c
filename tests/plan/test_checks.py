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
    ],
)
def test_unsupported_settings_are_named(raw: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        check_supported(load_config(raw), world_size=1)


def test_defaults_are_supported() -> None:
    check_supported(load_config({}), world_size=1)
