"""The batch arithmetic: any two of the three sizes determine the third; sizes that disagree or do not
divide are one line naming all three."""

from __future__ import annotations

import pytest

from hybridtrain.config import ConfigError, load_config
from hybridtrain.config.batch_sizes import resolve_batch_sizes


@pytest.mark.parametrize(
    ("given", "dp", "expected"),
    [
        ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, 2, (32, 4, 4)),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2, (16, 4, 2)),
        ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 1, (8, 2, 4)),
        ({}, 1, (1, 1, 1)),
    ],
)
def test_any_two_batch_sizes_determine_the_third(given: dict, dp: int, expected: tuple[int, int, int]) -> None:
    sizes = resolve_batch_sizes(load_config(given), dp)
    assert (sizes.global_batch, sizes.micro_batch, sizes.accumulation_steps) == expected


def test_inconsistent_batch_sizes_list_all_three() -> None:
    cfg = load_config({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2})
    with pytest.raises(ConfigError) as err:
        resolve_batch_sizes(cfg, 1)
    for part in ("train_batch_size=8", "train_micro_batch_size_per_gpu=3", "gradient_accumulation_steps=2"):
        assert part in str(err.value)
    with pytest.raises(ConfigError, match="multiple of"):
        resolve_batch_sizes(load_config({"train_batch_size": 10, "gradient_accumulation_steps": 4}), 1)
