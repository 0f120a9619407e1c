"""``deepspeed.checkpoint``: the helper Accelerate calls to save a state dict."""

from hybridtrain.deepspeed.checkpoint import utils

__all__ = ["utils"]
