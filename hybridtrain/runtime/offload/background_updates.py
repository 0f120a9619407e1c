"""Host updates that run after their step returned (``OffloadOptimizer.background``): the
device weights they still write, what waits for them, and the first failure among them.

A resident bucket's update uploads its weights from the host worker while the next
forward runs; :meth:`PendingWeights.reads_wait` makes the first op that reads one of them
wait for that bucket's update and upload (:mod:`~hybridtrain.runtime.offload.wait_before_reads`).
A failure is kept: every later wait raises it, so training never goes on from partly
updated weights.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from hybridtrain.runtime import transfer
from hybridtrain.runtime.offload.bucket import Bucket
from hybridtrain.runtime.offload.wait_before_reads import WaitBeforeReads
from hybridtrain.runtime.step_parts import step_part

_here = threading.local()


def in_background_update() -> bool:
    """Whether the calling thread is running a background update: the update of a step
    that has already returned, not of the step running now."""
    return bool(getattr(_here, "active", False))


@contextlib.contextmanager
def running_in_background() -> Iterator[None]:
    """Mark the calling thread as running a background update (:func:`in_background_update`)."""
    _here.active = True
    try:
        yield
    finally:
        _here.active = False


class PendingWeights:
    """Resident buckets updating in the background, by their device parameters, and the
    first failure of any background update (``failed``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.failed: BaseException | None = None
        self._waiters: dict[int, Callable[[], None]] = {}

    def __bool__(self) -> bool:
        return bool(self._waiters)

    def watch(self, bucket: Bucket) -> None:
        """``bucket`` updates in the background (its ``update`` set): reads of its device
        parameters wait for it."""
        waiter = functools.partial(self._await, bucket)
        self._waiters.update({id(p): waiter for p in bucket.params})

    def reads_wait(self) -> AbstractContextManager[Any]:
        """On this thread, the first op reading a watched weight waits for its update."""
        return WaitBeforeReads(self._waiters) if self._waiters else contextlib.nullcontext()

    def settled(self, buckets: Sequence[Bucket]) -> None:
        """Every update has finished: the compute stream waits for the uploads nothing
        read yet, and nothing is watched any more."""
        if self._waiters:
            for bucket in buckets:
                transfer.compute_waits(bucket.uploaded, self.device)
                bucket.uploaded = None
            self._waiters.clear()

    def _await(self, bucket: Bucket) -> None:
        update = bucket.update
        if update is not None:
            with step_part("host_optimizer"):
                error = update.exception()
            if error is not None:
                self.failed = error
                raise error
        transfer.compute_waits(bucket.uploaded, self.device)
        bucket.uploaded = None
        for p in bucket.params:
            self._waiters.pop(id(p), None)
