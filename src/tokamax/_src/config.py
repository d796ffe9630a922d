"""Library-wide options.

Options are read when an op is traced. `override` also changes a JAX user
context, so jitted functions called inside it retrace with the new options;
assigning to `OPTIONS` directly does not retrace what is already cached.
"""

import contextlib
import dataclasses
import enum
import os

import jax

from tokamax._src import validation


class CacheMiss(enum.StrEnum):
  """What happens when no tuned config exists for an op with something to tune.

  HEURISTICS: use the implementation's heuristic config.
  AUTOTUNE: tune the op for these arguments at trace time (remembered for the
    rest of the process).
  ERROR: raise `LookupError`, naming the op and its arguments.
  """

  HEURISTICS = "heuristics"
  AUTOTUNE = "autotune"
  ERROR = "error"


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _env_flag(name: str, *, default: bool) -> bool:
  """A boolean environment variable: 1/true/yes/on or 0/false/no/off; anything else raises."""
  raw = os.environ.get(name)
  value = (raw or "").strip().lower()
  if not value:
    return default
  if value in _FALSE:
    return False
  if value in _TRUE:
    return True
  raise ValueError(f"{name}={raw!r}: expected one of {', '.join(_TRUE + _FALSE)}.")


def _option_value(name: str, value, current):
  """`value` as option `name`'s type; a bool option takes bools and 0/1, not truthy strings."""
  if isinstance(current, bool):
    return validation.flag(name, value)
  try:
    return type(current)(value)
  except ValueError as e:
    raise ValueError(f"option {name!r}: {e}") from e


@dataclasses.dataclass
class _Options:
  """Attributes:

  cache_miss: What a cache miss does (`CacheMiss`); env TOKAMAX_CACHE_MISS.
  use_default_cache: Whether the config cache shipped for the device kind is
    consulted; env TOKAMAX_USE_DEFAULT_CACHE=0 turns it off.
  """

  cache_miss: CacheMiss = dataclasses.field(
    default_factory=lambda: CacheMiss(os.environ.get("TOKAMAX_CACHE_MISS", "heuristics"))
  )
  use_default_cache: bool = dataclasses.field(
    default_factory=lambda: _env_flag("TOKAMAX_USE_DEFAULT_CACHE", default=True)
  )


OPTIONS = _Options()

# Part of JAX's trace cache key: the options set by `override`.
_TRACE_CONTEXT = jax.make_user_context(())


@contextlib.contextmanager
def override(**changes):
  """Temporarily sets options, e.g. `with override(cache_miss="error"): ...`."""
  old = dataclasses.asdict(OPTIONS)
  for name in changes:
    if name not in old:
      raise ValueError(f"unknown option {name!r}; options are {list(old)}.")
  try:
    for name, value in changes.items():
      setattr(OPTIONS, name, _option_value(name, value, old[name]))
    key = tuple(sorted((k, str(v)) for k, v in dataclasses.asdict(OPTIONS).items()))
    with _TRACE_CONTEXT(key):
      yield OPTIONS
  finally:
    for name, value in old.items():
      setattr(OPTIONS, name, value)
