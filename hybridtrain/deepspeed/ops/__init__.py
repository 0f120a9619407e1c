"""``deepspeed.ops``: DeepSpeed's optimizers as torch optimizers with the same math (no op
build: torch's own Adam kernels run them), its op builders as availability reports
(:mod:`~hybridtrain.deepspeed.ops.op_builder`) and ``__compatible_ops__`` (op name → whether
the drop-in provides it), which tests read to skip what needs a built op."""

from hybridtrain.deepspeed.ops import adam, aio, op_builder

__all__ = ["__compatible_ops__", "adam", "aio", "op_builder"]

__compatible_ops__: dict[str, bool] = {name: builder.is_compatible() for name, builder in op_builder.ALL_OPS.items()}
