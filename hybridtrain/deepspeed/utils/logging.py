"""``deepspeed.utils.logging``: DeepSpeed's ``logger`` (a ``logging.Logger`` named
``DeepSpeed``, level INFO) and ``log_dist`` (a message from the listed ranks only)."""

from __future__ import annotations

import logging as _logging
from collections.abc import Sequence

__all__ = ["log_dist", "logger"]

logger = _logging.getLogger("DeepSpeed")
if not logger.handlers:
    _handler = _logging.StreamHandler()
    _handler.setFormatter(_logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(_logging.INFO)
    logger.propagate = False


def log_dist(message: str, ranks: Sequence[int] | None = None, level: int = _logging.INFO) -> None:
    """Log ``message`` on the ranks in ``ranks`` (all with ``[-1]``; rank 0 when None)."""
    from hybridtrain.deepspeed.comm import get_rank

    rank = get_rank()
    wanted = [0] if ranks is None else list(ranks)
    if -1 in wanted or rank in wanted:
        logger.log(level, f"[Rank {rank}] {message}")
