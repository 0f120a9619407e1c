"""``deepspeed.runtime.utils``: seeding."""

from __future__ import annotations

import random

import torch

__all__ = ["set_random_seed"]


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator (``seed mod 2**32``, its range;
    when NumPy is installed) and torch (``seed mod 2**63``), as DeepSpeed's ``set_random_seed``."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:  # not a hybridtrain dependency; nothing of NumPy's to seed then
        pass
    else:
        numpy.random.seed(seed % (2**32))
    torch.manual_seed(seed % (2**63))
