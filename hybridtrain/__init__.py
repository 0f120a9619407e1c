"""hybridtrain: train PyTorch models larger than one GPU's memory, with plain-PyTorch math."""

from __future__ import annotations

__version__ = "0.1.0"
