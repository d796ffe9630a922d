"""`AutotuningResult`: tuned configs with their device kind, as stable JSON.

Entered as a context manager, a result is the innermost of the active results
that `cache.lookup` consults first. The active results are the value of a JAX
user context, so they are part of JAX's trace cache key: a jitted function
called inside another set of results retraces.
"""

import contextvars
import dataclasses
import functools
import hashlib
import io
import itertools
import json
import os
from collections.abc import Mapping
from typing import Any, Self

import jax

from tokamax._src import arguments, version
from tokamax._src.autotuning import configs
from tokamax._src.autotuning.autotuner import AutotuningData

# The active AutotuningResults, innermost last; part of JAX's trace cache key.
_ACTIVE = jax.make_user_context(())
# The JAX contexts entered by `push`, innermost last (per thread, like _ACTIVE).
_ENTERED: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar("entered", default=())


def active_results() -> tuple[Any, ...]:
  """The entered results, innermost last."""
  return _ACTIVE.value


def push(result: Any) -> None:
  """Makes `result` the innermost active result (until `pop`)."""
  context = _ACTIVE((*_ACTIVE.value, result))
  context.__enter__()
  _ENTERED.set((*_ENTERED.get(), context))


def pop() -> None:
  """Undoes the last `push` of this thread."""
  *rest, context = _ENTERED.get()
  _ENTERED.set(tuple(rest))
  context.__exit__(None, None, None)


FORMAT = "tokamax.AutotuningResult"
FORMAT_VERSION = 1


def _entry_key(data: AutotuningData) -> tuple[str, str, str]:
  return (data.op, data.implementation, data.key)


@dataclasses.dataclass(frozen=True, eq=False)
class AutotuningResult:
  """Tuned configs by op, implementation and argument signature.

  Use as a context manager (nestable, innermost first) to make jitted
  functions use these configs; outside every result the shipped default cache
  and `tokamax.config.OPTIONS.cache_miss` decide. Two results with the same
  content are equal and hash alike.

  Attributes:
    device_kind: `jax.Device.device_kind` of the device tuned on.
    data: One `AutotuningData` per (op, implementation, key), sorted.
    library_version: The tokamax version that tuned.
  """

  device_kind: str
  data: tuple[AutotuningData, ...] = ()
  library_version: str = version.__version__

  def __post_init__(self):
    unique = {_entry_key(d): d for d in self.data}  # The last entry of a key wins.
    object.__setattr__(self, "data", tuple(unique[k] for k in sorted(unique)))

  # -- Lookup -------------------------------------------------------------------

  @functools.cached_property
  def _index(self) -> dict[tuple[str, str, str], AutotuningData]:
    return {_entry_key(d): d for d in self.data}

  def data_for(self, op: Any, key: str) -> AutotuningData | None:
    """The entry of `op` (an implementation) for a signature key, or None."""
    data = self._index.get((op.spec.name, op.name, key))
    return None if data is None else dataclasses.replace(data, config_cls=op.config_cls)

  def config_for(self, bound: Any) -> Any:
    """The tuned config of a bound op call, or None."""
    data = self.data_for(bound.op, arguments.signature_key(bound.args))
    return None if data is None else data.fastest_config

  def __len__(self) -> int:
    return len(self.data)

  # -- Identity -----------------------------------------------------------------

  @functools.cached_property
  def fingerprint(self) -> str:
    return hashlib.sha256(self.dumps().encode()).hexdigest()

  def __eq__(self, other: object) -> bool:
    return isinstance(other, AutotuningResult) and self.fingerprint == other.fingerprint

  def __hash__(self) -> int:
    return hash(self.fingerprint)

  # -- Serialization ------------------------------------------------------------

  def to_json(self) -> dict[str, Any]:
    def load(text):
      return None if text is None else json.loads(text)

    return {
      "format": FORMAT,
      "format_version": FORMAT_VERSION,
      "device_kind": self.device_kind,
      "library_version": self.library_version,
      "data": [
        {
          "op": d.op,
          "implementation": d.implementation,
          "key": d.key,
          "mode": d.mode,
          "config": load(d.config),
          "timings_ms": [[load(c), t] for c, t in d.timings_ms],
          "errors": [[load(c), e] for c, e in d.errors],
          "heuristic": load(d.heuristic),
        }
        for d in self.data
      ],
    }

  @classmethod
  def from_json(cls, obj: Mapping[str, Any]) -> Self:
    if obj.get("format") != FORMAT:
      raise ValueError(
        f"not an autotuning result: format {obj.get('format')!r}, expected {FORMAT!r}."
      )
    if obj.get("format_version") != FORMAT_VERSION:
      raise ValueError(
        f"unsupported autotuning result format_version {obj.get('format_version')!r}."
      )

    def dump(value):
      return None if value is None else configs.canonical(value)

    data = tuple(
      AutotuningData(
        op=d["op"],
        implementation=d["implementation"],
        key=d["key"],
        mode=d.get("mode", "forward"),
        config=dump(d.get("config")),
        timings_ms=tuple((dump(c), float(t)) for c, t in d.get("timings_ms", ())),
        errors=tuple((dump(c), str(e)) for c, e in d.get("errors", ())),
        heuristic=dump(d.get("heuristic")),
      )
      for d in obj["data"]
    )
    return cls(device_kind=obj["device_kind"], data=data, library_version=obj["library_version"])

  def dumps(self) -> str:
    """The result as stable JSON text (sorted keys and entries)."""
    return json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n"

  @classmethod
  def loads(cls, text: str) -> Self:
    return cls.from_json(json.loads(text))

  def dump(self, fp: io.TextIOBase | str | os.PathLike) -> None:
    """Writes `dumps()` to a text file object or a path."""
    if isinstance(fp, str | os.PathLike):
      with open(fp, "w") as f:
        f.write(self.dumps())
    else:
      fp.write(self.dumps())

  @classmethod
  def load(cls, fp: io.TextIOBase | str | os.PathLike) -> Self:
    """Reads a result from a text file object or a path."""
    if isinstance(fp, str | os.PathLike):
      with open(fp) as f:
        return cls.loads(f.read())
    return cls.loads(fp.read())

  # -- Combination and use --------------------------------------------------------

  def merge(self, *others: "AutotuningResult") -> "AutotuningResult":
    """One result with the entries of all; a later result wins on a shared key.

    The merged result keeps the library version of its parts where they all
    share one (merging results tuned by one older version does not relabel them
    as tuned by this one); parts of several versions get the current version.
    """
    for other in others:
      if other.device_kind != self.device_kind:
        raise ValueError(
          f"cannot merge results of device kinds {self.device_kind!r} and {other.device_kind!r}."
        )
    data = itertools.chain(self.data, *(o.data for o in others))
    versions = {self.library_version, *(o.library_version for o in others)}
    merged_version = versions.pop() if len(versions) == 1 else version.__version__
    return AutotuningResult(self.device_kind, tuple(data), merged_version)

  def __or__(self, other: "AutotuningResult") -> "AutotuningResult":
    return self.merge(other)

  def __enter__(self) -> Self:
    push(self)
    return self

  def __exit__(self, *exc_info) -> None:
    pop()
