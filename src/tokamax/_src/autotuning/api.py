"""Public autotuning API: find the ops in a function, tune them, keep the result.

`autotune(f, *args)` traces `f` once with a recorder on (every op call goes
through `Op.apply`, and a custom backward pass through `_with_custom_vjp`), so
the ops of a gradient are found too. Each op with more than one candidate
config is tuned on the device; the `AutotuningResult` holds the chosen configs
with the device kind and library version, in a stable JSON format. Entered as
a context manager, a result overrides the shipped default cache; jitted
functions called inside it retrace and use its configs.
"""

import itertools
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from tokamax._src import arguments
from tokamax._src.autotuning import autotuner, cache
from tokamax._src.autotuning.autotuner import AutotuningData as AutotuningData
from tokamax._src.autotuning.result import FORMAT as FORMAT
from tokamax._src.autotuning.result import FORMAT_VERSION as FORMAT_VERSION
from tokamax._src.autotuning.result import AutotuningResult as AutotuningResult
from tokamax._src.ops import op as op_lib

# -- Finding ops ------------------------------------------------------------------

# Part of JAX's trace cache key while ops are recorded: a fresh value each time,
# so that a jitted function traced before is traced again (and its ops seen).
_DISCOVERY = jax.make_user_context(None)
_DISCOVERY_COUNTER = itertools.count()


def _as_abstract(x: Any) -> Any:
  if isinstance(x, jax.Array | np.ndarray | jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
  return x


def find_ops(
  f: Callable[..., Any], *args: Any, kwargs: Mapping[str, Any] | None = None
) -> list[tuple[op_lib.BoundArguments, str]]:
  """The op calls made when tracing `f(*args, **kwargs)`, with their modes.

  Array arguments (or `jax.ShapeDtypeStruct`s) are traced, other leaves are
  passed as they are. The mode is "forward_and_vjp" for an op whose custom
  backward pass ran (it is in the gradient), else "forward". Calls with the
  same op and signature are reported once, in order of first appearance.
  """
  leaves, tree = jax.tree.flatten((args, dict(kwargs or {})))
  leaves = [_as_abstract(x) for x in leaves]
  traced = [isinstance(x, jax.ShapeDtypeStruct) for x in leaves]

  def call(arrays):
    it_a, it_o = iter(arrays), iter(x for x, t in zip(leaves, traced, strict=True) if not t)
    call_args, call_kwargs = tree.unflatten([next(it_a) if t else next(it_o) for t in traced])
    return f(*call_args, **call_kwargs)

  calls: list = []
  token = op_lib.RECORDED_CALLS.set(calls)
  try:
    with _DISCOVERY(next(_DISCOVERY_COUNTER)):
      jax.make_jaxpr(call)([x for x, t in zip(leaves, traced, strict=True) if t])
  finally:
    op_lib.RECORDED_CALLS.reset(token)
  found: dict[tuple, list] = {}
  for op, record, mode in calls:
    key = (op, arguments.signature_key(record))
    entry = found.setdefault(key, [op_lib.BoundArguments(op, record), "forward"])
    if mode == "vjp":
      entry[1] = "forward_and_vjp"
  return [(bound, mode) for bound, mode in found.values()]


def get_bound_args(
  f: Callable[..., Any], *args: Any, kwargs: Mapping[str, Any] | None = None
) -> tuple[op_lib.BoundArguments, ...]:
  """The unique op calls (implementation and abstract arguments) made by `f`."""
  return tuple(bound for bound, _ in find_ops(f, *args, kwargs=kwargs))


def _implementations(bound: op_lib.BoundArguments) -> Iterable[op_lib.Op]:
  """Every implementation of the op that loads and supports the arguments here."""
  spec = bound.op.spec
  yield bound.op
  for name in spec.implementation_names:
    if name == bound.op.name:
      continue
    try:  # A module that fails to load (for any reason) is not available.
      if isinstance(spec.implementation_class_or_reason(name), str):
        continue
      op = spec.get(name)
      supported = op.unsupported_reason(bound.args) is None
    except Exception:
      continue
    if supported:
      yield op


# -- Tuning -----------------------------------------------------------------------


def autotune(
  f: Callable[..., Any] | Sequence[op_lib.BoundArguments],
  *args: Any,
  ignore_cache: bool = False,
  all_implementations: bool = False,
  ignore_errors: bool = True,
  kwargs: Mapping[str, Any] | None = None,
  timeout_s: float = autotuner.DEFAULT_TIMEOUT_S,
  max_workers: int | None = None,
  iterations: int = autotuner.DEFAULT_ITERATIONS,
  method: str | None = None,
  time_budget_s: float | None = None,
  seed: int = 0,
  progress: bool = True,
) -> AutotuningResult:
  """Tunes every tokamax op in `f(*args, **kwargs)`, its gradient included.

  Args:
    f: A function (jitted or not, e.g. `jax.jit(jax.grad(loss))`), or a
      sequence of `BoundArguments` to tune directly.
    *args: Example arguments of `f`: arrays or `jax.ShapeDtypeStruct`s (only
      shapes and dtypes matter); other leaves are passed as they are.
    ignore_cache: Tune even ops that the active results, the configs tuned on
      misses or the default cache already cover (else their cached entries are
      copied into the result).
    all_implementations: Also tune every other implementation of each op that
      supports its arguments here.
    ignore_errors: Record an op whose tuning fails as an entry without config;
      if False, raise.
    kwargs: Keyword arguments of `f`.
    timeout_s: Compile time allowed to one candidate.
    max_workers: Compile threads per op.
    iterations: Timed runs per candidate.
    method: Timing method (see `tokamax.benchmark`); None for the best.
    time_budget_s: Stop starting new ops after this many seconds; the ops left
      get an entry with the error "skipped: time budget".
    seed: Seed of the random inputs.
    progress: Show progress on stderr.

  Returns:
    The `AutotuningResult` of the ops with something to tune.
  """
  found = find_ops(f, *args, kwargs=kwargs) if callable(f) else [(b, "forward") for b in f]
  work: dict[tuple, tuple[op_lib.BoundArguments, str]] = {}
  for bound, mode in found:
    if bound.op.config is not None:  # A fixed config: nothing to choose.
      continue
    ops = _implementations(bound) if all_implementations else (bound.op,)
    for op in ops:
      b = op_lib.BoundArguments(op, arguments.abstract(bound.args))
      key = (op.spec.name, op.name, arguments.signature_key(b.args))
      if key in work:
        mode = "forward_and_vjp" if "forward_and_vjp" in (mode, work[key][1]) else mode
      work[key] = (b, "forward" if op.tuned_on_forward else mode)
  results, tunable = [], []
  for key, (b, mode) in work.items():
    try:
      if len(b.op._get_autotuning_configs(b.args)) > 1:
        tunable.append((key, b, mode))
    except Exception as e:
      if not ignore_errors:
        raise
      results.append(_failed(key, mode, f"candidates: {type(e).__name__}: {e}"))
  kind = cache.device_kind()
  start = time.monotonic()
  for i, (key, bound, mode) in enumerate(tunable):
    label = f"({i + 1}/{len(tunable)}) {key[0]}[{key[1]}] {mode}"
    cached = None if ignore_cache else cache.lookup_data(bound.op, key[2], kind, bound.args)
    if cached is not None and cached.config is not None:
      _note(progress, f"{label}: cached")
      results.append(cached)
      continue
    if time_budget_s is not None and time.monotonic() - start > time_budget_s:
      _note(progress, f"{label}: skipped (time budget)")
      results.append(_failed(key, mode, "skipped: time budget"))
      continue
    _note(progress, f"{label}: {key[2]}")
    try:
      data = autotuner.autotune_call(
        bound.op,
        bound.args,
        mode=mode,
        timeout_s=timeout_s,
        max_workers=max_workers,
        iterations=iterations,
        method=method,
        seed=seed,
        progress=progress,
      )
    except Exception as e:
      if not ignore_errors:
        raise
      data = _failed(key, mode, f"{type(e).__name__}: {e}")
    if data.config is None and not ignore_errors:
      raise RuntimeError(f"{key[0]}[{key[1]}]: every candidate failed: {data.errors}")
    results.append(data)
  return AutotuningResult(device_kind=kind, data=tuple(results))


def _failed(key: tuple[str, str, str], mode: str, message: str) -> AutotuningData:
  return AutotuningData(
    op=key[0], implementation=key[1], key=key[2], mode=mode, config=None, errors=((None, message),)
  )


def _note(enabled: bool, text: str) -> None:
  if enabled:
    print(f"[tokamax.autotune] {text}", file=sys.stderr, flush=True)
