"""The base of every config section: unknown keys are errors, docstrings are descriptions, and a
boolean is never taken for a number."""

from __future__ import annotations

from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, docstrings are descriptions."""

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic would take true as 1 for a number field (YAML's yes too): say so instead.
        if isinstance(value, bool) and info.field_name is not None:
            allowed = _numbers_allowed(cls.model_fields[info.field_name].annotation)
            if allowed:
                raise ValueError(f"{str(value).lower()} is a boolean; give {allowed}")
        return value


def _numbers_allowed(annotation: Any) -> str | None:
    """What a field of numbers that takes no booleans allows (``"an integer"``, ``"a number"``,
    ``"one of 0, 1, 2, 3"``), else None."""
    if get_origin(annotation) is Literal:
        values = get_args(annotation)
        numbers = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
        return "one of " + ", ".join(map(str, values)) if numbers and not any(v is True for v in values) else None
    args = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    if bool in args or not ({int, float} & set(args)):
        return None
    return "an integer" if float not in args else "a number"
