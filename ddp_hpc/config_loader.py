"""Build nested dataclasses from plain YAML data, with errors that name the key path.

Only what YAML's safe loader produces is accepted (str, int, float, bool, None, lists,
dicts); objects are named by strings (a dotted import path or a registry name).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from ddp_hpc.errors import UserError

T = TypeVar("T")
_SCIENTIFIC = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


class ConfigError(UserError):
    """A config value is unknown, mistyped or impossible; the message names its key path."""


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    origin = get_origin(tp)
    if origin is not None:
        return getattr(origin, "__name__", str(origin))
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        errors = []
        for option in get_args(tp):
            try:
                return _convert(value, option, path)
            except ConfigError as exc:
                errors.append(exc)
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise ConfigError(f"{path}: expected one of {', '.join(repr(a) for a in get_args(tp))}, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{path}: expected null, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping of keys, got {value!r}")
        return build(tp, value, path)
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if origin is list or tp is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        (item_type,) = get_args(tp) or (Any,)
        return [_convert(item, item_type, f"{path}[{i}]") for i, item in enumerate(value)]
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # YAML 1.1 (PyYAML) reads 1e-3 as a string: accept plain scientific notation.
        if isinstance(value, str) and _SCIENTIFIC.match(value.strip()):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"unsupported config type {tp!r} at {path}")
    raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")


def build(cls: type[T], data: Mapping[str, Any], path: str = "") -> T:
    """An instance of dataclass ``cls`` from ``data``; unknown keys are refused."""
    hints = get_type_hints(cls)
    fields = {config_key(f): f.name for f in dataclasses.fields(cls) if f.init}
    names = list(fields)
    kwargs = {}
    for key, value in data.items():
        key_path = f"{path}.{key}" if path else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(names)})"
            raise ConfigError(f"unknown key {key_path!r}{hint}")
        kwargs[fields[key]] = _convert(value, hints[fields[key]], key_path)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        if path and not str(exc).startswith(path):
            raise ConfigError(f"{path}.{exc}") from None
        raise


def config_key(f: dataclasses.Field) -> str:
    """The YAML key of a config field: its name, or ``metadata["key"]`` where the key is a
    Python keyword (``checkpoint.async`` is the field ``async_write``)."""
    return f.metadata.get("key", f.name)


def to_plain(obj: Any) -> Any:
    """Dataclasses back to plain dicts (for writing the resolved config)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {config_key(f): to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"training.batch_size=64"`` -> (["training", "batch_size"], 64); values are YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} is not KEY=VALUE (e.g. training.batch_size=64)")
    parts = key.strip().split(".")
    if any(not part for part in parts):
        raise ConfigError(f"override key {key!r} has an empty part")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {'.'.join(parts[:depth + 1])} is not a section")
            node = child
        node[parts[-1]] = value
    return data


def positive(value: float | int, path: str) -> None:
    if value <= 0:
        raise ConfigError(f"{path} must be > 0, got {value}")


def non_negative(value: float | int, path: str) -> None:
    if value < 0:
        raise ConfigError(f"{path} must be >= 0, got {value}")

