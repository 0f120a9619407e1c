"""Stand-in for the parts of ``torchvision`` the DeepSpeed examples here use (torchvision is
not installable in our sandbox, and the examples must not download): ``datasets.CIFAR10``
yields random 3×32×32 images in [-1, 1] with labels 0–9 (the shapes and types of the real
transformed dataset), ``transforms`` are pass-throughs. Size: ``HYBRIDTRAIN_SYNTHETIC_SAMPLES``
(default 256 train; test: a quarter of it, at least 40)."""

from __future__ import annotations

import os
import types
from typing import Any

import torch
from torch.utils.data import TensorDataset


class CIFAR10(TensorDataset):
    def __init__(self, root: str = "", train: bool = True, download: bool = False, transform: Any = None) -> None:
        size = int(os.environ.get("HYBRIDTRAIN_SYNTHETIC_SAMPLES", "256"))
        # The test set has every class (the script divides by each class's count) and a
        # multiple of its test batch size 4.
        size = size if train else max(40, size // 4 // 20 * 20)
        gen = torch.Generator().manual_seed(0 if train else 1)
        labels = torch.randint(0, 10, (size,), generator=gen) if train else torch.arange(size) % 10
        super().__init__(torch.rand(size, 3, 32, 32, generator=gen) * 2 - 1, labels)


def _identity(*args: Any, **kwargs: Any) -> Any:
    return lambda x: x


datasets = types.SimpleNamespace(CIFAR10=CIFAR10)
transforms = types.SimpleNamespace(Compose=_identity, ToTensor=_identity, Normalize=_identity)
