"""``deepspeed.ops.op_builder``: DeepSpeed's op builders as availability reports.

DeepSpeed compiles C++/CUDA ops; the drop-in compiles nothing. A builder here says whether
what the op provides is available under the drop-in (``is_compatible()``): ``cpu_adam`` and
``fused_adam`` are (:mod:`hybridtrain.deepspeed.ops.adam` runs their math on torch's Adam),
every other op is not, and ``load()`` says so in one line. Tests and frameworks read
``deepspeed.ops.__compatible_ops__`` (built from :data:`ALL_OPS`) to skip what needs an op.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ALL_OPS", "AsyncIOBuilder", "CPUAdagradBuilder", "CPUAdamBuilder", "CPULionBuilder", "FusedAdamBuilder",
           "GDSBuilder", "NotImplementedBuilder", "OpBuilder", "get_default_compute_capabilities"]


class OpBuilder:
    """One op: its ``NAME``, whether the drop-in provides it, and ``load``."""

    NAME = ""
    PROVIDED = False
    """Whether the drop-in provides the op's function (without building anything)."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.name}.{self.name}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        """Whether the op is available under the drop-in (never a build)."""
        return self.PROVIDED

    def builder(self) -> None:
        raise NotImplementedError(f"op {self.name!r}: hybridtrain's DeepSpeed drop-in builds no ops")

    def load(self, verbose: bool = True) -> Any:
        """DeepSpeed returns the compiled op module; the drop-in has none to return.

        Raises:
            NotImplementedError: always (naming the op and what to use instead).
        """
        instead = " (deepspeed.ops.adam provides its optimizer)" if self.PROVIDED else ""
        raise NotImplementedError(f"op {self.name!r} is not built by hybridtrain's DeepSpeed drop-in{instead}")


def _builder(class_name: str, name: str, provided: bool = False) -> type[OpBuilder]:
    return type(class_name, (OpBuilder,), {"NAME": name, "PROVIDED": provided, "__module__": __name__,
                                           "__doc__": f"The ``{name}`` op ({'provided' if provided else 'absent'})."})


# The builders DeepSpeed 0.19.8 lists on a CPU (its ALL_OPS there), plus the NVMe/GDS ones tests name.
NotImplementedBuilder = _builder("NotImplementedBuilder", "deepspeed_not_implemented")
AsyncIOBuilder = _builder("AsyncIOBuilder", "async_io")
GDSBuilder = _builder("GDSBuilder", "gds")
CCLCommBuilder = _builder("CCLCommBuilder", "deepspeed_ccl_comm")
ShareMemCommBuilder = _builder("ShareMemCommBuilder", "deepspeed_shm_comm")
CPUAdagradBuilder = _builder("CPUAdagradBuilder", "cpu_adagrad")
CPUAdamBuilder = _builder("CPUAdamBuilder", "cpu_adam", provided=True)
CPULionBuilder = _builder("CPULionBuilder", "cpu_lion")
FusedAdamBuilder = _builder("FusedAdamBuilder", "fused_adam", provided=True)
PinMemoryBuilder = _builder("PinMemoryBuilder", "pin_memory")

ALL_OPS: dict[str, OpBuilder] = {cls.NAME: cls() for cls in (
    NotImplementedBuilder, AsyncIOBuilder, CCLCommBuilder, ShareMemCommBuilder, CPUAdagradBuilder, CPUAdamBuilder,
    CPULionBuilder, FusedAdamBuilder, PinMemoryBuilder)}


def get_default_compute_capabilities() -> str:
    """DeepSpeed's default CUDA architectures string (nothing is compiled here)."""
    return "6.0;6.1;7.0"
