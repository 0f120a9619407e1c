"""Mixed precision: autocast and DeepSpeed-style loss scaling, and which weights autocast
reads only in half (so they may cross host and device in half, exactly).

- :mod:`.scaling`: :func:`autocast`, :class:`LossScaler`, the reported loss
- :mod:`.half_width`: the half-width decision and the reads that keep it exact
"""

from __future__ import annotations

from hybridtrain.runtime.precision.half_width import (
    WeightReads,
    graph_uses,
    half_width_params,
    matmul_reads_only,
)
from hybridtrain.runtime.precision.scaling import (
    LossScaler,
    autocast,
    found_inf_flag,
    precision_name,
    reported_loss,
)

__all__ = [
    "LossScaler",
    "WeightReads",
    "autocast",
    "found_inf_flag",
    "graph_uses",
    "half_width_params",
    "matmul_reads_only",
    "precision_name",
    "reported_loss",
]
