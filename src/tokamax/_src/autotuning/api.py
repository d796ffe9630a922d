"""Public autotuning API (in progress: see issue 7)."""

from typing import Any


class AutotuningResult:
  """Tuned configs per op, implementation and argument signature."""

  def __init__(self, device_kind: str = "", data: dict | None = None):
    self.device_kind = device_kind
    self.data = dict(data or {})

  def lookup(self, op: Any, key: str) -> Any | None:
    return self.data.get((op.spec.name, op.name, key))


def autotune(f, *args, **kwargs) -> AutotuningResult:
  """Tunes every tokamax op in `f(*args)`."""
  raise NotImplementedError("tokamax.autotune is not implemented yet.")
