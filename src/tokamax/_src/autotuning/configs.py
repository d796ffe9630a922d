"""Configs as canonical JSON: a stable text form for results and cache files.

A config is a frozen dataclass whose fields are JSON scalars, enums, tuples or
nested config dataclasses. `encode` gives the canonical JSON string (sorted
keys, no spaces), the identity of a config in results; `decode` rebuilds the
object for a config class from the parsed JSON.
"""

import dataclasses
import enum
import json
import types
import typing
from typing import Any


def to_json(value: Any) -> Any:
  """`value` as plain JSON data."""
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
  if isinstance(value, enum.Enum):
    return to_json(value.value)
  if isinstance(value, tuple | list):
    return [to_json(v) for v in value]
  if isinstance(value, bool | int | float | str) or value is None:
    return value
  if hasattr(value, "item"):  # NumPy scalars.
    return value.item()
  raise TypeError(
    f"cannot write config field value {value!r} of type {type(value).__name__} as JSON."
  )


def canonical(data: Any) -> str:
  """Plain JSON data as canonical text: sorted keys, no spaces."""
  return json.dumps(data, sort_keys=True, separators=(",", ":"))


def encode(config: Any) -> str:
  """The canonical JSON string of `config`."""
  return canonical(to_json(config))


def _from_json(hint: Any, value: Any) -> Any:
  if value is None:
    return None
  origin = typing.get_origin(hint)
  if origin in (typing.Union, types.UnionType):
    for option in typing.get_args(hint):
      if option is type(None):
        continue
      try:
        return _from_json(option, value)
      except (TypeError, ValueError):
        continue
    return _plain(value)
  if isinstance(hint, type) and dataclasses.is_dataclass(hint) and isinstance(value, dict):
    return decode_json(hint, value)
  if isinstance(hint, type) and issubclass(hint, enum.Enum):
    return hint(value)
  if isinstance(value, list):
    args = typing.get_args(hint)
    if origin is tuple and args and args[-1] is not Ellipsis and len(args) == len(value):
      return tuple(_from_json(a, v) for a, v in zip(args, value, strict=True))
    inner = args[0] if args else Any
    return tuple(_from_json(inner, v) for v in value)
  return value


def _plain(value: Any) -> Any:
  return tuple(_plain(v) for v in value) if isinstance(value, list) else value


def decode_json(config_cls: type, data: dict) -> Any:
  """The `config_cls` instance of parsed JSON `data`."""
  if not dataclasses.is_dataclass(config_cls):
    raise TypeError(f"config class {config_cls!r} is not a dataclass.")
  hints = typing.get_type_hints(config_cls)
  names = {f.name for f in dataclasses.fields(config_cls)}
  unknown = set(data) - names
  if unknown:
    raise ValueError(f"{config_cls.__name__} has no fields {sorted(unknown)}.")
  return config_cls(**{k: _from_json(hints.get(k, Any), v) for k, v in data.items()})


def decode(config_cls: type, text: str) -> Any:
  """The `config_cls` instance of canonical JSON `text`."""
  return decode_json(config_cls, json.loads(text))
