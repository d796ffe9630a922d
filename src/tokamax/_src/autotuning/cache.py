"""Where tuned configs come from, in order.

1. The `AutotuningResult`s entered as context managers, innermost first. They
   are the value of a JAX user context, so they are part of JAX's trace cache
   key: a jitted function called inside another set of results retraces.
2. Configs tuned in this process on a cache miss (`cache_miss="autotune"`).
3. The default cache shipped for the device kind under `tokamax/data/`
   (when `config.OPTIONS.use_default_cache`), less the entries written by an
   older config class (a field missing), which were tuned on older kernels.
4. A miss: heuristics, autotuning or an error, as `config.OPTIONS.cache_miss`
   says. An op with at most one candidate config has nothing to tune and
   always falls back to its heuristics.
"""

import dataclasses
import functools
import importlib.resources
import json
import pathlib
import re
import threading
from typing import Any

from tokamax._src import arguments, config, device
from tokamax._src.autotuning import autotuner, result

# Configs tuned on a cache miss: (device kind, op, implementation, key) -> AutotuningData.
_TUNED_ON_MISS: dict[tuple[str, str, str, str], Any] = {}
_TUNED_ON_MISS_LOCK = threading.Lock()

DATA_DIR = pathlib.Path(str(importlib.resources.files("tokamax") / "data"))


def device_kind() -> str:
  return device.default_device().device_kind


def file_name(kind: str) -> str:
  """The default cache file name of a device kind, e.g. "NVIDIA_H200.json"."""
  return re.sub(r"[^A-Za-z0-9.-]+", "_", kind).strip("_") + ".json"


@functools.cache
def default_result(kind: str) -> Any | None:
  """The shipped `AutotuningResult` of a device kind, or None."""
  path = DATA_DIR / file_name(kind)
  if not path.is_file():
    return None
  with path.open() as f:
    return result.AutotuningResult.load(f)


def lookup_data(op: Any, key: str, kind: str | None = None) -> Any | None:
  """The cached `AutotuningData` of `op` for a signature key, or None."""
  kind = kind or device_kind()
  for active in reversed(result.active_results()):
    data = active.data_for(op, key)
    if data is not None:
      return data
  data = _TUNED_ON_MISS.get((kind, op.spec.name, op.name, key))
  if data is not None:
    return data
  if config.OPTIONS.use_default_cache:
    default = default_result(kind)
    if default is not None and default.device_kind == kind:
      data = default.data_for(op, key)
      return data if data is not None and _written_by_current_config(data, op) else None
  return None


def _written_by_current_config(data: Any, op: Any) -> bool:
  """Whether a shipped entry names every field of `op`'s config class.

  The autotuner writes every field, so a missing one marks an entry tuned on an
  older kernel, whose choice the heuristics have since superseded.
  """
  if data.config is None or not dataclasses.is_dataclass(op.config_cls):
    return True
  return set(json.loads(data.config)) == {f.name for f in dataclasses.fields(op.config_cls)}


def _nothing_to_tune(op: Any, args: Any) -> bool:
  return len(op._get_autotuning_configs(args)) <= 1


def lookup(op: Any, args: Any) -> Any | None:
  """The config of `op` for `args` from the caches, or None for heuristics."""
  key = arguments.signature_key(args)
  data = lookup_data(op, key)
  if data is not None:  # With no working candidate, the heuristics.
    return data.fastest_config
  miss = config.OPTIONS.cache_miss
  if miss == config.CacheMiss.HEURISTICS or _nothing_to_tune(op, args):
    return None
  if miss == config.CacheMiss.ERROR:
    raise LookupError(
      f"{op.spec.name}[{op.name}]: no tuned config for {key} on {device_kind()} "
      "(tokamax.config.OPTIONS.cache_miss='error'); run tokamax.autotune and enter its result."
    )
  data = autotuner.autotune_call(op, arguments.abstract(args))
  with _TUNED_ON_MISS_LOCK:
    _TUNED_ON_MISS[(device_kind(), op.spec.name, op.name, key)] = data
  return data.fastest_config


def clear_tuned_on_miss() -> None:
  """Forgets the configs tuned on cache misses."""
  with _TUNED_ON_MISS_LOCK:
    _TUNED_ON_MISS.clear()
