"""``resolve``: the plan is a pure value made without processes, and bad input is refused
there, before the model changes."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hybridtrain.config import ConfigError
from hybridtrain.models.gpt import build_gpt
from hybridtrain.plan import resolve
from tests.equivalence import gpt_case
from tests.parallel.scenarios import InlineTiedLM, ResidualMLP

BATCH = gpt_case().batches(1)[0]


def _pp(**extra: Any) -> dict[str, Any]:
    return {"device": "cpu", "pipeline": {"stages": 2, "schedule": "gpipe", "micro_batches": 2, **extra}}


class EncoderDecoder(nn.Module):
    """Two block lists; decoder blocks read the encoder's output (T5/BART shape)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, width)
        self.encoder = nn.ModuleList(ResidualMLP(width) for _ in range(2))
        self.decoder = nn.ModuleList(CrossBlock(width) for _ in range(3))
        self.head = nn.Linear(width, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        memory = self.emb(tokens)
        for block in self.encoder:
            memory = block(memory)
        hidden = self.emb(tokens)
        for block in self.decoder:
            hidden = block(hidden, memory)
        return self.head(hidden)


class CrossBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.mix = nn.Linear(2 * width, width)

    def forward(self, hidden: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return hidden + self.mix(torch.cat([hidden, memory], dim=-1))


class BlockWeightOutside(InlineTiedLM):
    """Reads block 0's weight after the blocks: a pipeline cannot hold it on one stage."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = super().forward(tokens)
        return hidden + self.blocks[0].mlp[1].bias.sum()


class ResidualOutside(InlineTiedLM):
    """Adds a residual between blocks, outside them: the stage boundary would drop it."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.emb(tokens)
        for block in self.blocks:
            hidden = hidden + block(hidden)
        return self.norm(hidden) @ self.emb.weight.T


def test_plan_is_a_value_and_touches_nothing() -> None:
    model = build_gpt("gpt-tiny")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = resolve({"device": "cpu", "gradient_accumulation_steps": 2,
                    "activation_checkpointing": {"enabled": True, "every_n_blocks": 2}}, model, world_size=1)
    assert (plan.sizes.dp, plan.sizes.tp, plan.sizes.pp) == (1, 1, 1)
    assert plan.block_lists == ("blocks",) and [b.name for b in plan.blocks] == ["blocks.0", "blocks.1"]
    assert plan.blocks_where("checkpoint") == ["blocks.0"] and plan.step_runner == "micro_batches"
    assert plan.batch.accumulation_steps == 2 and plan.optimizer.placement == "device"
    assert plan == resolve({"device": "cpu", "gradient_accumulation_steps": 2,
                            "activation_checkpointing": {"enabled": True, "every_n_blocks": 2}}, model, world_size=1)
    assert all(not hasattr(m, "_hybridtrain_original_forward") for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_plans_compare() -> None:
    model = build_gpt("gpt-tiny")
    plain = resolve({"device": "cpu"}, model, world_size=1)
    streamed = resolve({"device": "cpu", "gradient_accumulation_steps": 2,
                        "layer_streaming": {"enabled": True, "layer_major": True}}, model, world_size=1)
    assert streamed.step_runner == "layer_major" and streamed.optimizer.placement == "host_streamed"
    assert streamed.blocks_where("stream") == ["blocks.0", "blocks.1"]
    changed = plain.differences(streamed)
    assert changed["streamed"] == ("none", "all") and changed["step_runner"] == ("micro_batches", "layer_major")
    assert "world" not in changed


def test_pipeline_plan_without_processes() -> None:
    model = InlineTiedLM()
    plan = resolve({**_pp(partition="params")}, model, world_size=2, example_batch=BATCH)
    assert not dist.is_initialized()
    assert plan.pipeline is not None and plan.pipeline.counts == (2, 2) and plan.step_runner == "pipeline"
    # The head `h @ self.emb.weight.T` is code, not a module: the trace still sees both uses.
    assert plan.pipeline.usage.places["emb.weight"] == {"pre", "post"}
    assert plan.pipeline.usage.places["norm.weight"] == {"post"}
    assert plan.summary()["pipeline"]["blocks_per_stage"] == [2, 2]  # type: ignore[index]
    assert [b.stage for b in plan.blocks] == [0, 0, 1, 1]


def test_block_lists_of_an_encoder_decoder() -> None:
    model = EncoderDecoder()
    plan = resolve({"device": "cpu", "activation_checkpointing": {"enabled": True}}, model, world_size=1)
    assert plan.block_lists == ("encoder", "decoder")
    assert plan.blocks_where("checkpoint") == ["encoder.0", "encoder.1", "decoder.0", "decoder.1", "decoder.2"]
    one = resolve({"device": "cpu", "model": {"blocks": "decoder"}, "layer_streaming": {"enabled": True}},
                  model, world_size=1)
    assert one.blocks_where("stream") == ["decoder.0", "decoder.1", "decoder.2"]


@pytest.mark.parametrize(("model", "config", "world", "example", "needle"), [
    (InlineTiedLM(), _pp(), 2, None, "needs one example batch"),
    (BlockWeightOutside(), _pp(), 2, BATCH, r"parameter blocks\.0\.mlp\.1\.bias belongs to block 0 .* after the"),
    (ResidualOutside(), _pp(), 2, BATCH, "block 1 of blocks does not receive block 0's output"),
    (EncoderDecoder(), _pp(), 2, BATCH, "pipeline needs one list of blocks, but the model has encoder and decoder"),
    (EncoderDecoder(), {"device": "cpu", "layer_streaming": {"enabled": True, "layer_major": True}}, 1, None,
     "layer_major: false"),
    (BlockWeightOutside(), {"device": "cpu", "layer_streaming": {"enabled": True}}, 1, BATCH,
     r"layer_streaming: parameter blocks\.0\.mlp\.1\.bias .* layer_streaming.resident"),
    (nn.Linear(2, 2), {"device": "cpu", "activation_checkpointing": {"enabled": True}}, 1, None,
     "activation_checkpointing: could not find the repeated blocks"),
    (nn.Linear(2, 2), {"device": "cpu", "model": {"blocks": ["weight"]}, "layer_streaming": {"enabled": True}}, 1,
     None, "is a Parameter|does not exist"),
    (nn.Linear(2, 2), {"device": "cpu", "optimizer": {"type": "Sgdd"}}, 1, None, "Sgdd"),
])
def test_bad_input_is_one_config_error(model: nn.Module, config: dict[str, Any], world: int, example: Any,
                                       needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        resolve(config, model, world_size=world, example_batch=example)
    assert not dist.is_initialized()


class NormedBlocks(nn.Module):
    """Linear blocks (bf16 under autocast: nothing promotes the hidden state back to fp32)
    with a BatchNorm, whose running statistics a traced forward would move."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x.float()).sum()


def test_trace_follows_precision_and_leaves_buffers_and_rng() -> None:
    model, example = NormedBlocks(), torch.randn(4, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    plan = resolve({**_pp(), "bf16": {"enabled": True}}, model, world_size=2, example_batch=example)
    assert plan.pipeline is not None
    assert {dtype for _, dtype in plan.pipeline.usage.boundary[1:]} == {torch.bfloat16}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)


def test_cpu_checkpointing_swaps_the_modules_chosen_by_class() -> None:
    plan = resolve({"device": "cpu", "activation_checkpointing": {
        "enabled": True, "cpu_checkpointing": True, "module_classes": ["MLP"]}}, build_gpt("gpt-tiny"), world_size=1)
    assert plan.checkpoint_modules == plan.swap_modules == ("blocks.0.mlp", "blocks.1.mlp")


class SequenceFirst(InlineTiedLM):
    """Blocks see ``(seq, batch, width)``."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.emb(tokens).transpose(0, 1)
        for block in self.blocks:
            hidden = block(hidden)
        return (self.norm(hidden) @ self.emb.weight.T).transpose(0, 1)


def test_optimizers_and_models_a_technique_cannot_take() -> None:
    model = build_gpt("gpt-tiny")
    with pytest.raises(ConfigError, match="tensor_parallel replaces the model's parameters"):
        resolve({"device": "cpu", "tensor_parallel": {"size": 2}}, model, world_size=2,
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match="not have the batch as its first dimension"):
        resolve(_pp(), SequenceFirst(), world_size=2, example_batch=BATCH)
    with pytest.raises(ConfigError, match="schedule gpipe needs at least as many micro-batches"):
        resolve(_pp(micro_batches=1), InlineTiedLM(), world_size=2, example_batch=BATCH)


def test_deepspeed_zero3_offload_on_one_process_is_layer_streaming() -> None:
    plan = resolve({"device": "cpu", "zero_optimization": {
        "stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
        "offload_optimizer": {"device": "cpu", "pin_memory": True}}}, build_gpt("gpt-tiny"), world_size=1)
    assert plan.blocks_where("stream") == ["blocks.0", "blocks.1"]
    assert plan.optimizer.placement == "host_streamed" and plan.config.layer_streaming.pin_memory


def test_a_meta_model_is_traced_once_for_every_variant_of_one_batch_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner resolves hundreds of variants of one meta model: a meta forward sees
    shapes only, so its usage trace is taken once per batch shape; another shape, or a
    model changed in between, is traced again."""
    resolve_module = importlib.import_module("hybridtrain.plan.resolve")  # the package exports the function
    calls = []
    real = resolve_module.trace_usage
    monkeypatch.setattr(resolve_module, "trace_usage", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.device("meta"):
        model = gpt_case().build()
    tokens = torch.zeros(2, 16, dtype=torch.long, device="meta")
    streaming = {"device": "cpu", "layer_streaming": {"enabled": True}}
    first = resolve(streaming, model, 1, example_batch=(tokens, tokens))
    for variant in ({"layer_streaming": {"enabled": True, "boundary_activations": "host"}},
                    {"layer_streaming": {"enabled": True, "layer_major": True},
                     "zero_optimization": {"offload_optimizer": {"ratio": 0.6}}}):
        resolve({"device": "cpu", **variant}, model, 1, example_batch=(tokens, tokens))
    assert len(calls) == 1 and first.blocks_where("stream")
    resolve(streaming, model, 1, example_batch=(tokens[:, :8], tokens[:, :8]))
    assert len(calls) == 2
    model.blocks[0].register_parameter("extra", nn.Parameter(torch.zeros(1, device="meta")))
    resolve(streaming, model, 1, example_batch=(tokens, tokens))
    assert len(calls) == 3


def test_streaming_that_would_stream_no_block_is_one_line_naming_the_ratio_that_would() -> None:
    """Twin-Flow's device share (the last parameters) reaching into every block, or a
    ``resident`` list naming every block, leaves layer streaming nothing to stream: refused
    before any work, with the smallest ratio that streams a block — which does."""
    model = gpt_case().build()
    low = {"device": "cpu", "layer_streaming": {"enabled": True},
           "zero_optimization": {"offload_optimizer": {"ratio": 0.05}}}
    with pytest.raises(ConfigError, match=r"ratio = 0\.05 keeps a parameter of every block") as refused:
        resolve(low, model, 1)
    least = float(str(refused.value).split("at least ")[1].split(" ")[0])
    enough = {**low, "zero_optimization": {"offload_optimizer": {"ratio": least}}}
    assert resolve(enough, model, 1).blocks_where("stream")
    with pytest.raises(ConfigError, match="keeps a parameter of every block"):
        resolve({**low, "zero_optimization": {"offload_optimizer": {"ratio": round(least - 0.02, 2)}}}, model, 1)
    everything = {"device": "cpu",
                  "layer_streaming": {"enabled": True, "resident": ["blocks.0", "blocks.1", "blocks.2"]}}
    with pytest.raises(ConfigError, match="resident lists every block"):
        resolve(everything, model, 1)
