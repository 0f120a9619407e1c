"""The job states, by what they mean (no dependencies: the client and the CLI use them).

See :mod:`hybridtrain.service.store` for the transitions.
"""

from __future__ import annotations

#: Waiting for devices: new, queued again for a restart, or preempted (it resumes from the
#: checkpoint it saved when a job of higher priority took its devices).
WAITING = ("queued", "preempted")
#: Not ended yet.
ACTIVE = (*WAITING, "running")
#: Ended (``jobs resubmit`` queues such a job again). ``pruned``: an HPO trial that Optuna's
#: pruner stopped (a cancel that the trial's controller asked for on the pruner's word).
TERMINAL = ("succeeded", "failed", "cancelled", "pruned")
#: Every state, in lifecycle order (listings and metrics).
STATES = (*ACTIVE, *TERMINAL)
