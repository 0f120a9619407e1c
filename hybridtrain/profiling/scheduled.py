"""DeepSpeed's ``flops_profiler`` in a training loop: at ``profile_step`` the loop's next two
steps are profiled (the first counted, the second timed) and the profile is written.

The loop calls :meth:`ScheduledProfile.train_batch` instead of ``engine.train_batch``; the
steps train exactly as unprofiled ones do (same batches, same math), only slower.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridtrain.config import Config
from hybridtrain.profiling.profiler import Profile, ProfileSession


class ScheduledProfile:
    """Runs a profile at ``cfg.flops_profiler.profile_step`` (see the module docstring).

    Args:
        cfg: the run's config (``flops_profiler`` and ``train.output_dir``).
        writer: whether this process profiles and writes (rank 0, as DeepSpeed).
    """

    def __init__(self, cfg: Config, writer: bool = True) -> None:
        self.settings = cfg.flops_profiler
        self.active = self.settings.enabled and writer
        self.output_file = Path(self.settings.output_file) if self.settings.output_file else None
        self.output_dir = self.output_file.parent if self.output_file else Path(cfg.train.output_dir) / "profile"
        self.profile: Profile | None = None
        self._session: ProfileSession | None = None

    def train_batch(self, engine: Any, batch: Any, run: Callable[[Any], float] | None = None) -> float:
        """``run(batch)`` (default ``engine.train_batch``), or ``engine``'s profiled step when
        its turn comes; returns the loss."""
        if self._session is not None:
            loss = self._session.timed_step(batch)
            self._finish()
            return loss
        if self.active and self.profile is None and engine.global_step == self.settings.profile_step:
            self._session = ProfileSession(engine)
            return self._session.count_step(batch)
        return float(run(batch) if run is not None else engine.train_batch(batch))

    def _finish(self) -> None:
        assert self._session is not None
        self.profile = self._session.finish(self.output_dir)
        self._session = None
        text = self.profile.table()
        if self.output_file is not None:
            self.output_file.write_text(text + "\n")
            print(f"flops_profiler: profile written to {self.output_file}", file=sys.stderr, flush=True)
        else:
            print(text, flush=True)
