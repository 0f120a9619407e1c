"""``deepspeed.pipe`` on hybridtrain: ``PipelineModule`` + ``engine.train_batch()`` trains
like a plain loop that follows DeepSpeed's pipeline rules, on one process and split over
two, with a tied embedding.

DeepSpeed's rules the plain loops follow (deepspeed 0.19.8, ``deepspeed/runtime/``):

- ``train_batch`` pulls ``gradient_accumulation_steps`` micro-batches and runs the
  forward on ``batch[0]``, the loss ``loss_fn(outputs, batch[1])`` on the last stage
  (``pipe/engine.py`` 898, 916, 757);
- each micro-batch's backward is ``DeepSpeedEngine.backward(loss)``, which divides by
  ``gradient_accumulation_steps`` (``pipe/engine.py`` 799 → ``engine.py`` 3413);
- tied gradients are summed, then the clipped optimizer step runs once, after all
  micro-batches (``pipe/schedule.py`` 239-241, ``pipe/engine.py`` 1227);
- the loss returned is the micro-batch losses' sum over ``gradient_accumulation_steps``
  (``pipe/engine.py`` 577 → ``engine.py`` 2895), broadcast to every stage;
- the ``training_data`` loader reads the dataset in order (``DistributedSampler(shuffle=False)``,
  ``pipe/engine.py`` 263) and repeats;
- config ``Adam`` is AdamW (decoupled weight decay), as everywhere in DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridtrain.deepspeed as deepspeed
from hybridtrain.config import ConfigError
from hybridtrain.deepspeed.pipe import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec
from hybridtrain.deepspeed.pipe.setup import check_activations
from tests.parallel.spawn import run_ranks

MICRO, GAS, STEPS, LR, CLIP = 2, 4, 3, 1e-2, 0.5
CONFIG = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
          "optimizer": {"type": "Adam", "params": {"lr": LR}}}
VOCAB, WIDTH, SEQ = 32, 16, 8


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _mlp_layers() -> list[Any]:
    """Specs, an instance without parameters, a function and dropout (checkpointing must
    replay its masks)."""
    return [LayerSpec(nn.Linear, 6, 16), nn.Tanh(), _double, LayerSpec(nn.Linear, 16, 16), nn.Dropout(0.2),
            LayerSpec(nn.Linear, 16, 3)]


def _mlp_reference() -> tuple[list[nn.Linear], Callable[[torch.Tensor], torch.Tensor]]:
    """The same layers, built in the same order from the same seed, as a plain function."""
    torch.manual_seed(0)
    linears = [nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 3)]
    dropout = nn.Dropout(0.2)

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(linears[0](x)) * 2
        return linears[2](dropout(linears[1](h)))
    return linears, forward


def _micro_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(MICRO, 6, generator=gen), torch.randint(0, 3, (MICRO,), generator=gen)) for _ in range(n)]


def _plain_steps(params: list[nn.Parameter], loss_of: Callable[[Any], torch.Tensor],
                 micro: list[Any], steps: int) -> list[float]:
    """DeepSpeed's pipeline step by hand: GAS backwards of loss / GAS, clip, AdamW."""
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    losses = []
    for step in range(steps):
        total = 0.0
        for batch in micro[step * GAS:(step + 1) * GAS]:
            loss = loss_of(batch)
            (loss / GAS).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / GAS)
    return losses


def test_one_process_train_batch_matches_deepspeed_rules_by_hand() -> None:
    """num_stages=2 on one process (both stages here), checkpointing every layer chunk:
    train_batch(data_iter=…) × 3, then eval_batch with logits, = the plain loop."""
    micro = _micro_batches(STEPS * GAS)
    torch.manual_seed(0)
    module = PipelineModule(_mlp_layers(), num_stages=2, loss_fn=nn.CrossEntropyLoss(),
                            activation_checkpoint_interval=1)
    assert module.parts == [0, 3, 6]  # 'parameters': 112 | 272 + 51 (DeepSpeed's smallest spread)
    engine, optimizer, loader, _ = deepspeed.initialize(model=module, config=CONFIG)
    assert loader is None and optimizer is engine.optimizer and engine.is_first_stage() and engine.is_last_stage()
    torch.manual_seed(7)  # the dropout masks' stream
    data = iter(micro)
    losses = [engine.train_batch(data_iter=data) for _ in range(STEPS)]
    assert all(isinstance(loss, torch.Tensor) and loss.dim() == 0 for loss in losses)
    eval_loss, logits = engine.eval_batch(iter(micro[:GAS]), return_logits=True)

    linears, forward = _mlp_reference()
    params = [p for layer in linears for p in layer.parameters()]
    torch.manual_seed(7)
    expected = _plain_steps(params, lambda b: F.cross_entropy(forward(b[0]), b[1]), micro, STEPS)
    torch.testing.assert_close([float(v) for v in losses], expected, rtol=1e-5, atol=0)
    names = [f"layers.{i}.{kind}" for i in (0, 3, 5) for kind in ("weight", "bias")]
    state = engine.module.state_dict()
    for name, param in zip(names, params, strict=True):
        torch.testing.assert_close(state[name], param.detach(), rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        plain_eval = [F.cross_entropy(linears[2](linears[1](torch.tanh(linears[0](x)) * 2)), y).item()
                      for x, y in micro[:GAS]]
        last_logits = linears[2](linears[1](torch.tanh(linears[0](micro[GAS - 1][0])) * 2))
    assert float(eval_loss) == pytest.approx(sum(plain_eval) / GAS, rel=1e-5)
    torch.testing.assert_close(logits, last_logits, rtol=1e-5, atol=1e-6)
    assert engine.global_steps == STEPS and engine.train_batch_size() == MICRO * GAS


def test_training_data_is_read_in_dataset_order_and_repeats() -> None:
    """initialize(training_data=…) then train_batch(): micro-batches in dataset order,
    starting again after the last (10 samples = 5 micro-batches; 3 steps take 12)."""
    gen = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(10, 6, generator=gen), torch.randint(0, 3, (10,), generator=gen))
    torch.manual_seed(0)
    layers = [LayerSpec(nn.Linear, 6, 16), nn.Tanh(), _double, LayerSpec(nn.Linear, 16, 16), nn.Identity(),
              LayerSpec(nn.Linear, 16, 3)]
    module = PipelineModule(layers, num_stages=2, loss_fn=nn.CrossEntropyLoss(), partition_method="uniform")
    engine, _, loader, _ = deepspeed.initialize(model=module, config=CONFIG, training_data=data)
    assert loader is engine.training_dataloader
    losses = [float(engine.train_batch()) for _ in range(STEPS)]

    linears, _ = _mlp_reference()
    params = [p for layer in linears for p in layer.parameters()]
    order = [i % 10 for i in range(STEPS * GAS * MICRO)]
    micro = [(data.tensors[0][order[i:i + MICRO]], data.tensors[1][order[i:i + MICRO]])
             for i in range(0, len(order), MICRO)]
    expected = _plain_steps(params, lambda b: F.cross_entropy(
        linears[2](linears[1](torch.tanh(linears[0](b[0])) * 2)), b[1]), micro, STEPS)
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)


# ---------------------------------------------------------------- two processes, tied embedding
class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


def _tied_head(embedding: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return hidden @ embedding.weight.T


def _lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def _tokens(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    return [(torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen), torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen))
            for _ in range(n)]


def _lm_module(num_stages: int) -> PipelineModule:
    """A GPT-NeoX-style description: TiedLayerSpec embedding, blocks, the embedding as head."""
    torch.manual_seed(0)
    layers = [TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH), *[LayerSpec(_Block, WIDTH) for _ in range(4)],
              TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH, forward_fn=_tied_head)]
    return PipelineModule(layers, num_stages=num_stages, loss_fn=_lm_loss, partition_method="type:_block")


def _train_lm() -> tuple[list[float], float, dict[str, torch.Tensor], tuple[bool, bool]]:
    module = _lm_module(2)
    engine, _, _, _ = deepspeed.initialize(model=module, config=CONFIG)
    data = iter(_tokens(STEPS * GAS))
    losses = [float(engine.train_batch(data_iter=data)) for _ in range(STEPS)]
    evaluated = float(engine.eval_batch(iter(_tokens(GAS))))
    return losses, evaluated, engine.engine.model_state_dict(), (engine.is_first_stage(), engine.is_last_stage())


@pytest.mark.timeout(120)
def test_two_processes_with_a_tied_embedding_match_the_plain_loop() -> None:
    ranks = run_ranks(_train_lm, 2, timeout=100)
    assert [r[3] for r in ranks] == [(True, False), (False, True)]
    assert _lm_module(2).parts == [0, 3, 6]  # two _Block layers per stage

    torch.manual_seed(0)
    embedding = nn.Embedding(VOCAB, WIDTH)
    blocks = [_Block(WIDTH) for _ in range(4)]

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        hidden = embedding(tokens)
        for block in blocks:
            hidden = block(hidden)
        return hidden @ embedding.weight.T
    named = {"tied_modules.embed.weight": embedding.weight}
    named.update({f"layers.{i + 1}.{n}": p for i, block in enumerate(blocks) for n, p in block.named_parameters()})
    expected = _plain_steps(list(named.values()), lambda b: _lm_loss(forward(b[0]), b[1]), _tokens(STEPS * GAS), STEPS)
    with torch.no_grad():
        plain_eval = sum(_lm_loss(forward(x), y).item() for x, y in _tokens(GAS)) / GAS
    for losses, evaluated, state, _ in ranks:
        torch.testing.assert_close(losses, expected, rtol=1e-4, atol=0)
        assert evaluated == pytest.approx(plain_eval, rel=1e-4)
        assert set(state) == set(named)
        for name, param in named.items():
            torch.testing.assert_close(state[name], param.detach(), rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- DeepSpeed's partitions and rules
@pytest.mark.parametrize("seed", range(6))
def test_partitions_are_deepspeeds(seed: int) -> None:
    from deepspeed.runtime.utils import partition_balanced, partition_uniform

    from hybridtrain.deepspeed.pipe.partition import balanced_parts, uniform_parts

    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 14, (1,), generator=gen))
    weights = [int(w) for w in torch.randint(0, 5, (n,), generator=gen) ** 3]
    for parts in range(1, 6):
        assert balanced_parts(weights, parts) == [int(p) for p in partition_balanced(weights, parts)]
        assert uniform_parts(n, parts) == partition_uniform(n, parts)


def test_checkpointed_layers_follow_deepspeeds_chunks() -> None:
    """Chunks of 2 layers from each stage's start; a chunk with parameters is checkpointed
    (its layers with parameters, here); checkpointable_layers restricts by class name."""
    from hybridtrain.runtime.activations.recompute import is_checkpointed

    def layers() -> list[Any]:
        return [nn.Linear(4, 4), nn.ReLU(), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)]
    module = PipelineModule(layers(), num_stages=2, partition_method="uniform", activation_checkpoint_interval=2)
    # stage 0: [0,1] [2]; stage 1: [3,4] [5]
    assert [is_checkpointed(m) for m in module.layers] == [True, False, False, True, False, True]
    module.set_checkpoint_interval(0)
    assert not any(is_checkpointed(m) for m in module.layers)
    module = PipelineModule(layers(), num_stages=2, partition_method="uniform", activation_checkpoint_interval=1,
                            checkpointable_layers=["ReLU"])
    assert not any(is_checkpointed(m) for m in module.layers)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"seed_layers": True}, r"seed_layers=True\) is not supported .* allowed: False"),
    ({"partition_method": "profile"}, r"partition_method='profile'\) is not supported; use 'parameters'"),
    ({"partition_method": "type:Conv"}, r"partition_method='type:Conv'\): the regex matches no layer"),
    ({"activation_checkpoint_interval": -1}, r"activation_checkpoint_interval=-1\) must be an integer >= 0"),
    ({"num_stages": None}, "needs num_stages"),
])
def test_unsupported_module_arguments_are_refused_in_one_line(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PipelineModule([nn.Linear(4, 4), nn.Linear(4, 4)], **{"num_stages": 2, **kwargs})


@pytest.mark.parametrize(("world", "config", "module_kwargs", "match"), [
    (4, {}, {"num_stages": 3}, r"num_stages=3\) must divide the world size 4"),
    (2, {"zero_optimization": {"stage": 2}}, {}, "allows ZeRO stages 0 and 1 only"),
    (2, {"pipeline_model_parallel_size": 4}, {}, r"pipeline_model_parallel_size = 4 but PipelineModule\(num_stages=2"),
    (2, {"pipeline": {"virtual_stages": 2}}, {}, "pipeline.virtual_stages = 2 with a PipelineModule"),
    (4, {}, {"num_stages": 4, "partition_method": "uniform"}, "leaves stage 3 without layers"),
    (2, {}, {"dynamic_shape": True}, r"dynamic_shape=True\) across processes is not supported"),
])
def test_bad_pipeline_settings_are_refused_before_any_collective(world: int, config: dict[str, Any],
                                                                 module_kwargs: dict[str, Any], match: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # WORLD_SIZE without a process group: the error must come before joining one.
    monkeypatch.setenv("WORLD_SIZE", str(world))
    module = PipelineModule([nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)], **{"num_stages": 2, **module_kwargs})
    with pytest.raises((ConfigError, ValueError), match=match):
        deepspeed.initialize(model=module, config={**CONFIG, **config})


def test_activations_that_cannot_cross_processes_are_named() -> None:
    module = PipelineModule([nn.Linear(4, 4), lambda x: (x, x), lambda pair: pair[0], nn.Linear(4, 2)], num_stages=2,
                            partition_method="uniform")
    with pytest.raises(ValueError, match=r"layer 2 \(<lambda>\) receives a tuple; across processes"):
        check_activations(module, torch.randn(3, 4))
    module = PipelineModule([nn.Embedding(8, 4), nn.Linear(4, 2)], num_stages=2, partition_method="uniform")
    check_activations(module, torch.randint(0, 8, (3, 2)))  # token ids into layer 0, floats between stages: fine
    # a tensor of token ids crossing the boundary cannot carry a gradient back
    module = PipelineModule([nn.Identity(), nn.Embedding(8, 4)], num_stages=2, partition_method="uniform")
    with pytest.raises(ValueError, match=r"stage 1 starts at layer 1 \(Embedding\), which receives a torch.int64"):
        check_activations(module, torch.randint(0, 8, (3, 2)))


def test_checkpoint_round_trip_resumes_the_same_losses(tmp_path: Any) -> None:
    def build() -> Any:
        torch.manual_seed(0)
        module = PipelineModule(_mlp_layers()[:4] + [nn.Identity(), LayerSpec(nn.Linear, 16, 3)], num_stages=2,
                                loss_fn=nn.CrossEntropyLoss())
        return deepspeed.initialize(model=module, config=CONFIG)[0]
    micro = _micro_batches(4 * GAS)
    engine = build()
    data = iter(micro)
    engine.train_batch(data_iter=data)
    engine.train_batch(data_iter=data)
    engine.save_checkpoint(tmp_path, client_state={"epoch": 2})
    after = [float(engine.train_batch(data_iter=data)) for _ in range(2)]
    resumed = build()
    assert resumed.load_checkpoint(tmp_path) == (str(tmp_path / "global_step2"), {"epoch": 2})
    rest = iter(micro[2 * GAS:])
    assert [float(resumed.train_batch(data_iter=rest)) for _ in range(2)] == after
    assert resumed.global_steps == 4 and resumed.num_pipeline_stages() == 2  # read through to the module


def test_pipeline_engine_takes_train_batch_only_and_refuses_what_it_lacks() -> None:
    module = PipelineModule([nn.Linear(6, 3)], num_stages=1, loss_fn=nn.CrossEntropyLoss())
    engine, *_ = deepspeed.initialize(model=module, config=CONFIG)
    with pytest.raises(PipelineError, match=r"Only train_batch\(\)"):
        engine(torch.randn(2, 6))
    with pytest.raises(ValueError, match=r"reduce_output=None\) is not supported; allowed: 'avg'"):
        engine.eval_batch(iter(_micro_batches(GAS)), reduce_output=None)
    with pytest.raises(RuntimeError, match="no data; pass data_iter"):
        engine.train_batch()
    uneven = _micro_batches(GAS - 1) + [(torch.randn(1, 6), torch.zeros(1, dtype=torch.long))]
    with pytest.raises(ValueError, match=r"micro-batches of \[2, 2, 2, 1\] samples; they must be equal"):
        engine.train_batch(data_iter=iter(uneven))
    with torch.no_grad(), pytest.raises(RuntimeError, match="requires gradients enabled"):
        engine.train_batch(data_iter=iter(_micro_batches(GAS)))
