"""How a training run stops when asked: SIGTERM or Ctrl-C (a second Ctrl-C aborts), or the
launcher that started this worker dying; with several ranks, all of them agree after each
step, so every rank saves the same step."""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist


class StopRequest:
    """Turns SIGTERM/SIGINT into a flag checked between steps (a second Ctrl-C aborts).

    Under torchrun a worker also stops when its launcher is gone (``kill -9`` of
    ``hybridtrain train``, which cannot pass on a signal): it would otherwise train on as an
    orphan, and a relaunch would write into the same run beside it.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}
        self._launcher: int | None = None

    def __enter__(self) -> StopRequest:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        if "TORCHELASTIC_RUN_ID" in os.environ:
            self._launcher = os.getppid()
        return self

    def should_stop(self) -> bool:
        """Whether a signal asked to stop, or the launcher that started this worker died."""
        if not self.requested and self._launcher is not None and os.getppid() != self._launcher:
            self.requested = True
            if os.environ.get("RANK", "0") == "0":
                print(f"the launcher (pid {self._launcher}) is gone: stopping after this step and saving a "
                      "checkpoint", file=sys.stderr, flush=True)
        return self.requested

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        if os.environ.get("RANK", "0") == "0":  # the run's one line about the stop, not one per rank
            print(stop_line(signal.Signals(signum)), file=sys.stderr, flush=True)


def stop_line(sig: signal.Signals) -> str:
    """What a run says, at once, when a signal asks it to stop: the only line about it
    (how it ended is in the summary), so it says what comes next."""
    again = "; Ctrl-C again stops at once without saving" if sig == signal.SIGINT else ""
    return f"{sig.name}: stopping after this step and saving a checkpoint (continue with --resume{again})"


def on_any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` is set on any rank (itself alone in one process)."""
    if not dist.is_initialized():
        return flag
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
