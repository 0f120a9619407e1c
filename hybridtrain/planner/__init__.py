"""Plan before training: estimate what a step needs (bytes on the device and the host,
seconds) from the model traced on the meta device, and choose the fastest same-math plan
that fits (``hybridtrain estimate``, ``hybridtrain plan``, ``auto: true``, OOM fallback).

- :mod:`~hybridtrain.planner.trace`: a micro-batch traced on the meta device, per phase;
- :mod:`~hybridtrain.planner.memory` / :mod:`~hybridtrain.planner.timing`: a plan's step
  replayed over the trace, for bytes and seconds;
- :mod:`~hybridtrain.planner.estimate`: config → :class:`Estimate`;
- :mod:`~hybridtrain.planner.search`: same-math variants, ranked; :func:`fallback`;
- :mod:`~hybridtrain.planner.auto`: ``auto: true`` in :func:`hybridtrain.initialize` (its
  ``planned_config`` is internal to the road every engine takes, and not exported here).
"""

from hybridtrain.planner.auto import planned_config  # noqa: F401  (importable for old callers; internal)
from hybridtrain.planner.estimate import Estimate, Target, estimate, model_source, resolve_target
from hybridtrain.planner.search import Candidate, PlanResult, choose, fallback, plan

__all__ = ["Candidate", "Estimate", "PlanResult", "Target", "choose", "estimate", "fallback", "model_source",
           "plan", "resolve_target"]
