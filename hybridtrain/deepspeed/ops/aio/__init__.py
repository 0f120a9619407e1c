"""``deepspeed.ops.aio``: DeepSpeed's async-I/O (NVMe) op, reported unavailable under the drop-in."""

from hybridtrain.deepspeed.ops.op_builder import AsyncIOBuilder

__all__ = ["AsyncIOBuilder"]
