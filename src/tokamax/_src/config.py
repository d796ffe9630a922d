"""Library-wide options."""

import contextlib
import dataclasses
import enum
import os


class CacheMiss(enum.StrEnum):
  """What happens when no tuned config exists for a call."""

  HEURISTICS = "heuristics"
  AUTOTUNE = "autotune"
  ERROR = "error"


@dataclasses.dataclass
class _Options:
  cache_miss: CacheMiss = CacheMiss(os.environ.get("TOKAMAX_CACHE_MISS", "heuristics"))
  use_default_cache: bool = os.environ.get("TOKAMAX_USE_DEFAULT_CACHE", "1") != "0"


OPTIONS = _Options()


@contextlib.contextmanager
def override(**changes):
  """Temporarily sets options, e.g. `with override(cache_miss="error"): ...`."""
  old = dataclasses.asdict(OPTIONS)
  try:
    for name, value in changes.items():
      if not hasattr(OPTIONS, name):
        raise ValueError(f"unknown option {name!r}; options are {list(old)}.")
      setattr(OPTIONS, name, type(old[name])(value))
    yield OPTIONS
  finally:
    for name, value in old.items():
      setattr(OPTIONS, name, value)
