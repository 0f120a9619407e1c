"""The numbers of a raw config, checked before the schema uses them (a pure step).

- Every number anywhere in the config is one a run can compute with: no infinity (YAML's
  ``.inf``, or ``1.0e400``, which reads as one) and no integer past 2^63 - 1, whose
  arithmetic (a memory estimate in floats, a tensor size) would overflow.
- ``optimizer.params`` and ``scheduler.params`` are free-form keyword arguments, but the
  ones with a known meaning are typed here, so ``lr: abc`` is refused naming
  ``optimizer.params.lr`` instead of by the optimizer's own comparison of a float with a string.

Every error is one line naming the key path, the value and what is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel

LARGEST_INTEGER = 2**63 - 1
"""The largest integer a config may hold (the largest signed 64-bit integer)."""


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _non_negative(value: Any) -> str | None:
    return None if _number(value) and value >= 0 else "a number ≥ 0"


def _integer(value: Any) -> str | None:
    integral = _number(value) and (isinstance(value, int) or float(value).is_integer())
    return None if integral and value >= 0 else "an integer ≥ 0"


def _signed_integer(value: Any) -> str | None:
    integral = _number(value) and (isinstance(value, int) or float(value).is_integer())
    return None if integral else "an integer"


def _boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else "true or false"


def _betas(value: Any) -> str | None:
    pair = isinstance(value, list | tuple) and len(value) == 2 and all(_number(b) and 0 <= b < 1 for b in value)
    return None if pair else "two numbers in [0, 1), [beta1, beta2]"


def _warmup_type(value: Any) -> str | None:
    return None if value in ("linear", "log") else "'linear' or 'log'"


Check = Callable[[Any], str | None]
"""What a value must be (its words), or None when it is that."""

OPTIMIZER_PARAMS: dict[str, Check] = {
    **dict.fromkeys(("lr", "eps", "weight_decay", "momentum", "dampening", "lr_decay", "initial_accumulator_value",
                     "alpha", "rho", "lambd", "t0", "momentum_decay", "max_coeff", "min_coeff", "coeff_beta"),
                    _non_negative),
    "betas": _betas,
    **dict.fromkeys(("amsgrad", "nesterov", "maximize", "capturable", "differentiable", "adam_w_mode",
                     "torch_adam", "bias_correction", "centered", "decoupled_weight_decay", "cuda_aware"), _boolean),
    **dict.fromkeys(("foreach", "fused"), lambda v: None if v is None else _boolean(v)),
    "freeze_step": _integer,
}
"""Typed keyword arguments of the optimizers (torch's, DeepSpeed's); others pass as given."""

SCHEDULER_PARAMS: dict[str, Check] = {
    **dict.fromkeys(("warmup_num_steps", "total_num_steps", "cycle_first_step_size", "cycle_first_stair_count",
                     "decay_step_size", "lr_range_test_step_size"), _integer),
    **dict.fromkeys(("cycle_second_step_size", "cycle_second_stair_count"),
                    lambda v: None if v is None else _integer(v)),
    "last_batch_iteration": _signed_integer,
    **dict.fromkeys(("warmup_min_lr", "warmup_min_ratio", "cos_min_ratio", "decay_lr_rate", "cycle_min_mom",
                     "cycle_max_mom", "decay_mom_rate", "lr_range_test_min_lr", "lr_range_test_step_rate"),
                    _non_negative),
    **dict.fromkeys(("warmup_max_lr", "cycle_min_lr", "cycle_max_lr"),
                    lambda v: None if v is None else _non_negative(v)),
    "warmup_type": _warmup_type,
    **dict.fromkeys(("cycle_momentum", "lr_range_test_staircase"), _boolean),
}
"""Typed parameters of the schedules (ours and DeepSpeed's, by DeepSpeed's names)."""


def check_numbers(raw: Any) -> None:
    """Refuse, in one line, the first unusable number of the raw config ``raw`` (see the
    module docstring); ``raw`` itself is not changed.

    Raises:
        ValueError: an infinite float, an integer past :data:`LARGEST_INTEGER`, or a typed
            optimizer/scheduler parameter of the wrong type.
    """
    _walk(_plain(raw), "")
    if not isinstance(raw, Mapping):
        return
    for section, known in (("optimizer", OPTIMIZER_PARAMS), ("scheduler", SCHEDULER_PARAMS)):
        params = _plain(raw.get(section))
        params = params.get("params") if isinstance(params, Mapping) else None
        if not isinstance(params, Mapping):
            continue  # the schema says what the section and its params must be
        for key, value in params.items():
            check = known.get(str(key))
            allowed = check(value) if check is not None else None
            if allowed:
                raise ValueError(f"{section}.params.{key} = {_shown(value)}: must be {allowed}")


def _plain(value: Any) -> Any:
    # A section given as a model instance (Config(optimizer=OptimizerConfig(...))) holds numbers too.
    return value.model_dump() if isinstance(value, BaseModel) else value


def _walk(value: Any, path: str) -> None:
    value = _plain(value)
    if isinstance(value, float) and math.isinf(value):
        raise ValueError(f"{path} = {value}: an infinity (or a number past ±1.8e308 such as 1e400, which reads as "
                         "one) is not allowed; give a finite number")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > LARGEST_INTEGER:
        raise ValueError(f"{path} = {_shown(value)}: larger than 2^63 - 1 = {LARGEST_INTEGER}; give a smaller number")
    if isinstance(value, Mapping):
        for key, item in value.items():
            _walk(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _walk(item, f"{path}[{index}]")


def _shown(value: Any) -> str:
    """``repr(value)``, with an integer too long to print in full shown by its size (Python
    refuses ``str()`` of one past 4300 digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 100:
        digits = int(value.bit_length() * math.log10(2)) + 1
        return f"{'a negative' if value < 0 else 'an'} integer of about {digits} digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
