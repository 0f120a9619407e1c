"""``deepspeed.accelerator.get_accelerator()`` for scripts written for DeepSpeed: CUDA when
present, else the CPU (as DeepSpeed's CPU accelerator), with the calls scripts make.

``from hybridtrain.deepspeed.accelerator import get_accelerator``.
"""

from __future__ import annotations

from typing import Any

import torch


class Accelerator:
    """The device scripts train on: ``cuda`` when available, else ``cpu``."""

    def __init__(self) -> None:
        self._name = "cuda" if torch.cuda.is_available() else "cpu"
        self._compile_backend = "inductor"

    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"``/``"cuda:N"``; on CPU always ``"cpu"`` (there is one CPU device)."""
        if self._name == "cpu" or device_index is None:
            return self._name
        return f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._name == "cuda" else "cpu"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._name == "cuda" else 0

    def set_device(self, device_index: int) -> None:
        if self._name == "cuda":
            torch.cuda.set_device(device_index)

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._name == "cuda" else 1

    def communication_backend_name(self) -> str:
        return "nccl" if self._name == "cuda" else "gloo"

    def synchronize(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._name == "cuda" else True

    def is_fp16_supported(self) -> bool:
        return True

    def empty_cache(self) -> None:
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._name == "cuda" else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._name == "cuda" else 0

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.reset_peak_memory_stats(device_index)

    def get_compile_backend(self) -> str:
        """The ``torch.compile`` backend ``engine.compile()`` uses by default (``inductor``)."""
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        """Set the default ``torch.compile`` backend; one ``torch.compile`` knows, else ValueError."""
        supported = torch.compiler.list_backends(exclude_tags=())
        if backend not in supported:
            raise ValueError(f"{backend} not supported by {self.device_name()}. Supported Backends are {supported}")
        self._compile_backend = backend

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"get_accelerator().{name} is a DeepSpeed accelerator call that "
                             "hybridtrain.deepspeed does not provide")


_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = Accelerator()
    return _ACCELERATOR
