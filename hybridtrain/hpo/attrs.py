"""Several user attributes (and intermediate values) of an Optuna trial in one transaction.

Optuna's public ``set_trial_user_attr`` commits once per attribute: on SQLite each call
costs about 1.5 ms of ORM work, and a trial's start writes five attributes (``slot``,
``attempt``, ``host``, ``command``, ``trial_dir``), the largest single item of the
service's per-trial overhead (``benchmarks/hpo_overhead.py``). :func:`set_user_attrs`
writes them in one session through the RDB storage's own per-attribute routine, and falls
back to the public call per attribute on a storage (or Optuna version) without it.

The same transaction can carry intermediate values: a poll of a running trial typically
has new objective values *and* the updated ``metrics`` attribute (and, on a trial's first
poll, its start attributes), which are then one commit instead of three or more.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping, Sequence
from typing import Any


@functools.cache
def _can_batch(storage_type: Any) -> bool:
    """Whether ``storage_type`` has the RDB attribute routine in the expected form."""
    method = getattr(storage_type, "_set_trial_attr_without_commit", None)
    if method is None:
        return False
    try:
        from optuna.storages._rdb import models
        from optuna.storages._rdb.storage import _create_scoped_session  # noqa: F401
    except ImportError:
        return False
    params = list(inspect.signature(method).parameters)
    report = getattr(storage_type, "_set_trial_intermediate_value_without_commit", None)
    return (params == ["self", "session", "model_cls", "trial_id", "key", "value"]
            and hasattr(models, "TrialUserAttributeModel") and report is not None
            and list(inspect.signature(report).parameters)
            == ["self", "session", "trial_id", "step", "intermediate_value"])


def set_user_attrs(storage: Any, trial_id: int, attrs: Mapping[str, Any],
                   intermediate: Sequence[tuple[int, float]] = ()) -> None:
    """Set ``attrs`` as user attributes of trial ``trial_id`` in one transaction.

    Args:
        storage: an Optuna storage (batched when it is an ``RDBStorage``).
        trial_id: the trial's storage id.
        attrs: JSON-serializable values by key.
        intermediate: ``(step, value)`` intermediate values to store in the same
            transaction (what ``Trial.report`` stores).

    Raises:
        optuna.exceptions.UpdateFinishedTrialError: the trial is already finished.
    """
    storage_type: Any = type(storage)  # a class is hashable; mypy's cache stub disagrees
    if not (_can_batch(storage_type) and hasattr(storage, "scoped_session")):
        for step, value in intermediate:
            storage.set_trial_intermediate_value(trial_id, step, value)
        for key, value in attrs.items():
            storage.set_trial_user_attr(trial_id, key, value)
        return
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _create_scoped_session

    with _create_scoped_session(storage.scoped_session, True) as session:
        for step, value in intermediate:
            storage._set_trial_intermediate_value_without_commit(session, trial_id, step,
                                                                 value)
        for key, value in attrs.items():
            storage._set_trial_attr_without_commit(session, models.TrialUserAttributeModel,
                                                   trial_id, key, value)
