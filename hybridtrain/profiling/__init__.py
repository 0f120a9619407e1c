"""Measuring what training costs: memory saved for backward, peak device memory."""

from hybridtrain.profiling.memory import SavedTensorMeter

__all__ = ["SavedTensorMeter"]
