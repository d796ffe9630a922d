"""Where tuned configs come from, in order.

1. The `AutotuningResult`s entered as context managers, innermost first. They
   are the value of a JAX user context, so they are part of JAX's trace cache
   key: a jitted function called inside another set of results retraces.
2. Configs tuned in this process on a cache miss (`cache_miss="autotune"`).
3. The default cache shipped for the device kind under `tokamax/data/`
   (when `config.OPTIONS.use_default_cache`), less the stale entries: those
   written by an older config class (a field missing) or tuned when the
   heuristics chose another config than they do now.
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
from tokamax._src.autotuning import autotuner, configs, result

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


def lookup_data(op: Any, key: str, kind: str | None = None, args: Any = None) -> Any | None:
  """The cached `AutotuningData` of `op` for a signature key, or None.

  Entered results and configs tuned on a miss are taken as they are; a shipped
  entry only where it is current for `args` (see `_current`), so never without
  `args`.
  """
  kind = kind or device_kind()
  for active in reversed(result.active_results()):
    data = active.data_for(op, key)
    if data is not None:
      return data
  data = _TUNED_ON_MISS.get((kind, op.spec.name, op.name, key))
  if data is not None:
    return data
  if config.OPTIONS.use_default_cache and args is not None:
    default = default_result(kind)
    if default is not None and default.device_kind == kind:
      data = default.data_for(op, key)
      return data if data is not None and _current(data, op, args) else None
  return None


def _current(data: Any, op: Any, args: Any) -> bool:
  """Whether a shipped entry was tuned against the current config and heuristics.

  The autotuner writes every config field and the heuristics' choice of the
  time. A missing field marks an entry tuned on an older kernel; another
  heuristic marks one that predates the measurements behind today's heuristics.
  Either way the heuristics win.
  """
  if data.config is None:
    return True
  if dataclasses.is_dataclass(op.config_cls):
    fields = {f.name for f in dataclasses.fields(op.config_cls)}
    if set(json.loads(data.config)) != fields:
      return False
  return data.heuristic == configs.encode(op._get_heuristics_config(args))


def _nothing_to_tune(op: Any, args: Any) -> bool:
  return len(op._get_autotuning_configs(args)) <= 1


def lookup(op: Any, args: Any) -> Any | None:
  """The config of `op` for `args` from the caches, or None for heuristics."""
  key = arguments.signature_key(args)
  data = lookup_data(op, key, args=args)
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
