"""Loading a :class:`Config` from a dict, a JSON/YAML file or CLI overrides, with
one-line errors that name the field, the value and what is allowed."""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from hybridtrain.bounded_parse import TooLargeError, check_bounds, load_json, load_yaml
from hybridtrain.config.deepspeed_keys import Applied, apply_treatments, log_treatments
from hybridtrain.config.schema import Config


class _YAMLLoader(yaml.SafeLoader):
    """SafeLoader that reads ``3e-4`` as a float, as YAML 1.2 and JSON do (YAML 1.1 needs a dot)."""


_YAMLLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml_load(text: str, source: str = "a --set value") -> Any:
    try:
        return load_yaml(text, source, _YAMLLoader)
    except TooLargeError as exc:
        raise ConfigError(str(exc)) from None


class ConfigError(ValueError):
    """A configuration that cannot run; the message is one line naming the field."""


ConfigSource = Config | Mapping[str, Any] | str | Path
Override = str | tuple[str, Any]
"""``"a.b=c"`` (``c`` parsed as a YAML scalar or list), or ``("a.b", value)``: the value as given
(a path from a command-line flag keeps its newlines, quotes and words like ``null``)."""


def load_config(source: ConfigSource | None = None, overrides: Iterable[Override] = ()) -> Config:
    """Build a validated :class:`Config`; what happened to DeepSpeed keys that have no
    effect here or were renamed is said once at info level.

    Args:
        source: a ``Config``, a dict, or the path of a JSON/YAML file (``None`` = defaults).
        overrides: applied on top: ``a.b=c`` strings (values parsed as YAML scalars/lists) or
            ``(key, value)`` pairs (values as given).

    Returns:
        The validated configuration.

    Raises:
        ConfigError: unreadable file, unknown or refused keys (all of them, in one line),
            wrong type or value.
    """
    config, applied = explain_config(source, overrides)
    log_treatments(applied)
    return config


def explain_config(source: ConfigSource | None = None,
                   overrides: Iterable[Override] = ()) -> tuple[Config, list[Applied]]:
    """:func:`load_config`, also returning the treatment every DeepSpeed key got
    (:mod:`hybridtrain.config.deepspeed_keys`), without logging it.

    A ``Config`` has been through the treatments already: its values are hybridtrain's own
    (``device = "auto"`` means detect the device, not DeepSpeed's placeholder), so it is
    validated again with its overrides (schema paths) but not treated a second time.
    """
    raw = config_as_written(source)
    if isinstance(source, Config):
        for item in overrides:
            _apply_override(raw, item)
        return _validated(raw), []
    for item in overrides:
        _apply_override(raw, item)
    try:
        raw, applied = apply_treatments(raw)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return _validated(raw), applied


def config_as_written(source: ConfigSource | None) -> dict[str, Any]:
    """``source``'s keys as written (a fresh copy, before DeepSpeed's keys are treated and
    defaults filled in): a file read, a mapping copied, a ``Config``'s keys that were set."""
    if isinstance(source, Config):
        return source.model_dump(exclude_unset=True)
    if source is None:
        return {}
    if isinstance(source, Mapping):
        try:
            return plain_copy(check_bounds(source, "the config"))
        except TooLargeError as exc:
            raise ConfigError(str(exc)) from None
    return read_config_file(Path(source))


def _validated(raw: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def plain_copy(value: Any) -> Any:
    """A config's nested mappings and lists copied as plain dicts and lists (keys as strings)."""
    if isinstance(value, Mapping):
        return {str(k): plain_copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain_copy(v) for v in value]
    return value


def read_config_file(path: Path) -> dict[str, Any]:
    """The mapping a JSON/YAML config file holds.

    Raises:
        ConfigError: a missing or unreadable file, or one that does not hold a mapping.
    """
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory; give the JSON/YAML file inside it")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {exc.start}: "
                          f"{exc.object[exc.start:exc.start + 1]!r}); save it as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {exc.strerror}") from None
    empty = ConfigError(f"config file {str(path)!r} is empty; write at least one key (e.g. "
                        "'train: {steps: 10}'), or give no config file for the defaults")
    if not text.strip():
        raise empty
    try:
        source = f"config file {str(path)!r}"
        data = load_json(text, source) if path.suffix == ".json" else _yaml_load(text, source)
    except TooLargeError as exc:
        raise ConfigError(str(exc)) from None
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError(f"config file {str(path)!r} is not valid JSON/YAML: {detail}") from None
    except ValueError as exc:  # an integer past Python's 4300-digit conversion limit
        raise ConfigError(f"config file {str(path)!r}: {_digits_words(exc)}") from None
    if data is None:  # only comments
        raise empty
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {str(path)!r} must hold a mapping of keys, not {type(data).__name__}"
        )
    return data


def _digits_words(exc: ValueError) -> str:
    """What an integer too long for Python to read means for the user (not Python's advice
    to raise its limit)."""
    if "integer string conversion" in str(exc):
        return "an integer of more than 4300 digits; numbers go up to 2^63 - 1"
    return " ".join(str(exc).split())


def _apply_override(raw: dict[str, Any], item: Override) -> None:
    if isinstance(item, tuple):
        key, value = item
    else:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like section.key=value")
        try:
            value = _parse_value(text)
        except ValueError as exc:  # an integer past Python's 4300-digit conversion limit
            raise ConfigError(f"override {key.strip()}=…: {_digits_words(exc)}") from None
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _parse_value(text: str) -> Any:
    """A YAML scalar or list; text that is not valid YAML stays a string."""
    try:
        return _yaml_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def _model_at(loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The pydantic model class that owns the field at ``loc`` (None inside free-form dicts)."""
    model: type[BaseModel] = Config
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        candidates = [field.annotation, *getattr(field.annotation, "__args__", ())]
        nested = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        if not nested:
            return None
        model = nested[0]
    return model


def format_validation_error(exc: ValidationError) -> str:
    """Turn pydantic's multi-line report into one line naming each bad field."""
    messages: list[str] = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        path = ".".join(str(p) for p in loc)
        if err["type"] == "extra_forbidden":
            parent = _model_at(loc[:-1])
            known = list(parent.model_fields) if parent else []
            close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
            hint = f"did you mean {'.'.join([*map(str, loc[:-1]), close[0]])!r}?" if close else (
                f"allowed keys: {', '.join(known)}" if known else "no keys allowed here"
            )
            messages.append(f"unknown config key {path!r} ({hint})")
        elif not loc:
            messages.append(str(err["msg"]).removeprefix("Value error, "))
        else:
            value = err.get("input")
            shown = repr(value) if not isinstance(value, dict) else "{…}"
            reason = str(err["msg"]).removeprefix("Value error, ")  # a field validator's own words
            messages.append(f"config {path} = {shown} is not allowed: {reason}")
    return "; ".join(messages)
