"""Hyperparameter optimization: Katib-style experiments on Optuna.

Trials are processes running any command; metrics come from their stdout (Katib's
``name=value`` format) or from :func:`report`; storage is Optuna's (SQLite by default,
PostgreSQL for many machines); experiments survive controller crashes through leases.

Only :func:`report` is imported eagerly (trial scripts use it and must start fast);
everything else loads on first access::

    from hybridtrain.hpo import run_experiment, load_spec, ExperimentStore
"""

from __future__ import annotations

import importlib
from typing import Any

from hybridtrain.hpo.push import report

_LAZY = {
    "run_experiment": "hybridtrain.hpo.experiments",
    "ExperimentStore": "hybridtrain.hpo.experiments",
    "ExperimentSpec": "hybridtrain.hpo.spec",
    "load_spec": "hybridtrain.hpo.spec",
    "HPOError": "hybridtrain.hpo.errors",
    "SpecError": "hybridtrain.hpo.errors",
    "ExperimentConflictError": "hybridtrain.hpo.errors",
    "StorageError": "hybridtrain.hpo.errors",
    "ExperimentNotFoundError": "hybridtrain.hpo.errors",
}

__all__ = ["report", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hybridtrain.hpo' has no attribute {name!r}")
