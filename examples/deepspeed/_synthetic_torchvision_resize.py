"""Stand-in for the torchvision parts DeepSpeedExamples' pipeline_parallelism/train.py uses
(torchvision is not installable in our sandbox, and the examples must not download):
``datasets.CIFAR10`` is :mod:`_synthetic_torchvision`'s random CIFAR-10-shaped data with the
script's transform applied to each image, and ``transforms`` does what torchvision's do to
such a tensor: ``Resize`` (shorter side, bilinear), ``CenterCrop``, ``Normalize``;
``ToTensor`` passes the image through (it is a tensor already)."""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from _synthetic_torchvision import CIFAR10 as _RandomCIFAR10


class CIFAR10(_RandomCIFAR10):
    def __init__(self, root: str = "", train: bool = True, download: bool = False, transform: Any = None) -> None:
        super().__init__(root, train, download)
        self.transform = transform

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, label = super().__getitem__(index)
        return (self.transform(image) if self.transform else image), label


def Compose(steps: Sequence[Callable[[Any], Any]]) -> Callable[[Any], Any]:  # noqa: N802 (torchvision's name)
    def run(x: Any) -> Any:
        for step in steps:
            x = step(x)
        return x
    return run


def Resize(size: int) -> Callable[[torch.Tensor], torch.Tensor]:  # noqa: N802
    def run(image: torch.Tensor) -> torch.Tensor:
        height, width = image.shape[-2:]
        scale = size / min(height, width)
        shape = (round(height * scale), round(width * scale))
        return F.interpolate(image[None], size=shape, mode="bilinear", align_corners=False)[0]
    return run


def CenterCrop(size: int) -> Callable[[torch.Tensor], torch.Tensor]:  # noqa: N802
    def run(image: torch.Tensor) -> torch.Tensor:
        top, left = (image.shape[-2] - size) // 2, (image.shape[-1] - size) // 2
        return image[..., top:top + size, left:left + size]
    return run


def ToTensor() -> Callable[[torch.Tensor], torch.Tensor]:  # noqa: N802
    return lambda image: image


def Normalize(mean: Sequence[float], std: Sequence[float]) -> Callable[[torch.Tensor], torch.Tensor]:  # noqa: N802
    mean_t, std_t = torch.tensor(mean)[:, None, None], torch.tensor(std)[:, None, None]
    return lambda image: (image - mean_t) / std_t


datasets = types.SimpleNamespace(CIFAR10=CIFAR10)
transforms = types.SimpleNamespace(Compose=Compose, Resize=Resize, CenterCrop=CenterCrop, ToTensor=ToTensor,
                                   Normalize=Normalize)
