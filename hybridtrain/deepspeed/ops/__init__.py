"""``deepspeed.ops``: DeepSpeed's optimizers as torch optimizers with the same math (no op
build: torch's own Adam kernels run them)."""

from hybridtrain.deepspeed.ops import adam

__all__ = ["adam"]
