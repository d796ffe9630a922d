"""Where tuned configs are looked up: active results first, then the shipped cache."""

import contextvars
from typing import Any

from tokamax._src import arguments

# The AutotuningResult objects entered as context managers, innermost last.
_ACTIVE: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar("active", default=())


def active_results() -> tuple[Any, ...]:
  return _ACTIVE.get()


def push(result: Any) -> contextvars.Token:
  return _ACTIVE.set((*_ACTIVE.get(), result))


def pop(token: contextvars.Token) -> None:
  _ACTIVE.reset(token)


def lookup(op: Any, args: Any) -> Any | None:
  """The tuned config of `op` for `args`, or None."""
  key = arguments.signature_key(args)
  for result in reversed(_ACTIVE.get()):
    config = result.lookup(op, key)
    if config is not None:
      return config
  return None
