"""Config loading: DeepSpeed keys, files, overrides, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import hybridtrain as ht
import hybridtrain.models
from hybridtrain.config import ConfigError, load_config

SOURCE_DOCUMENT_CONFIG = {
    "train_batch_size": 1024,
    "gradient_accumulation_steps": 4,
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
    "tensor_model_parallel_size": 2,
    "pipeline_model_parallel_size": 2,
    "fp16": {"enabled": True},
}


def test_source_document_config_loads_and_names_what_it_needs() -> None:
    cfg = load_config(SOURCE_DOCUMENT_CONFIG)
    assert cfg.zero_optimization.stage == 3 and cfg.fp16.enabled
    with pytest.raises(ConfigError, match="multiple of 4") as err:
        ht.initialize(ht.models.build_gpt("gpt-tiny"), SOURCE_DOCUMENT_CONFIG)
    assert "\n" not in str(err.value)
    assert "tensor_model_parallel_size=2" in str(err.value)


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"gradient_acumulation_steps": 2}, "did you mean 'gradient_accumulation_steps'"),
        ({"fp16": {"enabeld": True}}, "did you mean 'fp16.enabled'"),
        ({"gradient_clipping": "abc"}, "gradient_clipping = 'abc'"),
        ({"fp16": {"loss_scale_window": 0}}, "fp16.loss_scale_window = 0"),
        ({"zero_optimization": {"stage": 5}}, "zero_optimization.stage = 5"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "enable at most one"),
        ({"amp": {"enabled": True}}, "amp: NVIDIA Apex mixed precision"),
        ({"train": {"steps": -1}}, "train.steps = -1"),
        # A boolean is not taken as 1 (YAML's yes/no are booleans too).
        ({"layer_streaming": {"enabled": True, "keep_blocks_for_backward": True}},
         "layer_streaming.keep_blocks_for_backward = True is not allowed: true is a boolean; give an integer"),
        ({"gradient_clipping": False}, "gradient_clipping = False is not allowed: false is a boolean; give a number"),
        ({"zero_optimization": {"stage": True}}, "true is a boolean; give one of 0, 1, 2, 3"),
    ],
)
def test_bad_config_is_one_line_naming_the_field(raw: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(raw)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_json_yaml_and_overrides(tmp_path: Path) -> None:
    sgd = {"type": "SGD", "params": {"lr": 0.1}}
    (tmp_path / "c.json").write_text(json.dumps({"train_batch_size": 8, "optimizer": sgd}))
    (tmp_path / "c.yaml").write_text("train_batch_size: 8\noptimizer: {type: SGD, params: {lr: 1e-1}}\n")
    for name in ("c.json", "c.yaml"):
        cfg = load_config(tmp_path / name, ["optimizer.params.lr=3e-4", "bf16.enabled=true", "model.name=gpt-mini"])
        assert cfg.optimizer.params["lr"] == pytest.approx(3e-4)
        assert cfg.bf16.enabled is True and cfg.model.name == "gpt-mini" and cfg.train_batch_size == 8
    assert load_config(str(tmp_path / "c.yaml")) == load_config(load_config(tmp_path / "c.yaml"))


def test_unreadable_file_and_bad_override(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid JSON/YAML"):
        load_config(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config({}, ["no_equals_sign"])
    with pytest.raises(ConfigError, match="did you mean 'optimizer.type'"):
        load_config({}, ["optimizer.typo=SGD"])


def test_example_configs_load() -> None:
    examples = sorted(Path(__file__).resolve().parents[2].joinpath("examples").rglob("*.yaml"))
    assert examples
    for path in examples:
        if "hpo" not in path.parts:
            load_config(path)


def test_config_reference_documents_every_field() -> None:
    from hybridtrain.config.reference import config_reference
    from hybridtrain.config.schema import Config

    text = config_reference()
    for name, info in Config.model_fields.items():
        assert f"`{name}`" in text
        assert info.description, f"{name} has no docstring"
    assert "`fp16.loss_scale_window`" in text


def test_twin_flow_share_can_be_given_as_gpu_ratio() -> None:
    def offload(**keys: float) -> dict:
        return {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", **keys}}}

    assert load_config(offload(gpu_ratio=0.25)).zero_optimization.offload_optimizer.ratio == 0.75
    assert load_config(offload(gpu_ratio=0.25, ratio=0.75)).zero_optimization.offload_optimizer.ratio == 0.75
    with pytest.raises(ConfigError, match=r"ratio = 0.5 and gpu_ratio = 0.25 disagree"):
        load_config(offload(gpu_ratio=0.25, ratio=0.5))
    with pytest.raises(ConfigError, match=r"gpu_ratio = 1.5 is not allowed"):
        load_config(offload(gpu_ratio=1.5))


def test_a_loaded_config_loads_again_as_it_is_with_every_field_set() -> None:
    # A Config built from a full dump (memory plans, planner variants) sets device = "auto"
    # explicitly: hybridtrain's own value (detect the device), not DeepSpeed's placeholder.
    full = ht.Config.model_validate(load_config({"train_micro_batch_size_per_gpu": 2}).model_dump())
    assert full.device == "auto"
    assert load_config(full) == full
    assert load_config(full, ["device=cpu", "train.steps=3"]).model_dump() == {
        **full.model_dump(), "device": "cpu", "train": {**full.model_dump()["train"], "steps": 3}}
