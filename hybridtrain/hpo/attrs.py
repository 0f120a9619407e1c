"""Several user attributes of an Optuna trial in one database transaction.

Optuna's public ``set_trial_user_attr`` commits once per attribute: on SQLite each call
costs about 1.5 ms of ORM work, and a trial's start writes five attributes (``slot``,
``attempt``, ``host``, ``command``, ``trial_dir``), the largest single item of the
service's per-trial overhead (``benchmarks/hpo_overhead.py``). :func:`set_user_attrs`
writes them in one session through the RDB storage's own per-attribute routine, and falls
back to the public call per attribute on a storage (or Optuna version) without it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
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
    return params == ["self", "session", "model_cls", "trial_id", "key", "value"] and hasattr(
        models, "TrialUserAttributeModel")


def set_user_attrs(storage: Any, trial_id: int, attrs: Mapping[str, Any]) -> None:
    """Set ``attrs`` as user attributes of trial ``trial_id`` in one transaction.

    Args:
        storage: an Optuna storage (batched when it is an ``RDBStorage``).
        trial_id: the trial's storage id.
        attrs: JSON-serializable values by key.

    Raises:
        optuna.exceptions.UpdateFinishedTrialError: the trial is already finished.
    """
    storage_type: Any = type(storage)  # a class is hashable; mypy's cache stub disagrees
    if not (_can_batch(storage_type) and hasattr(storage, "scoped_session")):
        for key, value in attrs.items():
            storage.set_trial_user_attr(trial_id, key, value)
        return
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _create_scoped_session

    with _create_scoped_session(storage.scoped_session, True) as session:
        for key, value in attrs.items():
            storage._set_trial_attr_without_commit(session, models.TrialUserAttributeModel,
                                                   trial_id, key, value)
