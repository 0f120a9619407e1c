"""Layer-to-layer streaming: the model's blocks live in host memory and stream through the
device block by block (their update on the host, through optimizer offload).

- :mod:`.streamer`: :class:`LayerStreamer`, uploads, releases and gradient hand-offs
- :mod:`.layer_major`: :class:`LayerMajorRunner`, every micro-batch through one block at a time
- :mod:`.placement`: where a streamed model lives before its first step
- :mod:`.residency`: which blocks are on the device, over time
"""

from __future__ import annotations

from hybridtrain.runtime.streaming.layer_major import LayerMajorRunner
from hybridtrain.runtime.streaming.placement import check_not_shared, place_for_streaming
from hybridtrain.runtime.streaming.streamer import LayerStreamer

__all__ = [
    "LayerMajorRunner",
    "LayerStreamer",
    "check_not_shared",
    "place_for_streaming",
]
