"""``deepspeed.pipe`` on hybridtrain: describe a model as a list of layers, cut it into
stages, train it with ``engine.train_batch()``::

    from hybridtrain.deepspeed.pipe import PipelineModule, LayerSpec, TiedLayerSpec   # was: deepspeed.pipe

    model = PipelineModule(layers=[...], loss_fn=torch.nn.CrossEntropyLoss(), num_stages=2)
    engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config, training_data=dataset)
    loss = engine.train_batch()

The stages run on hybridtrain's pipeline (``torch.distributed.pipelining`` schedules),
see :mod:`hybridtrain.deepspeed.pipe.setup` for how each argument maps.
"""

from hybridtrain.deepspeed.pipe.engine import PipelineEngine, PipelineError
from hybridtrain.deepspeed.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineEngine", "PipelineError", "PipelineModule", "TiedLayerSpec"]
