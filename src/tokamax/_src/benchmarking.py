"""Benchmarking: standardized functions, compile once, time the device.

`standardize_function` turns a function and example arguments (arrays or
`jax.ShapeDtypeStruct`s, which get random values) into `(fn, arrays)` where
`fn(arrays)` runs the forward pass, the forward pass keeping residuals, the
backward pass or both. `benchmark(fn, arrays)` lowers and compiles `fn` once,
then times `iterations` runs:

- "wallclock": host time around each call and `block_until_ready`, after a
  warm-up call. Works on every backend; includes dispatch overhead.
- "cupti": kernel time only, summed over the kernels of one run, through
  CUPTI (`jax.experimental.mosaic.gpu.profiler.Cupti`, shipped with jaxlib's
  CUDA plugin). NVIDIA GPUs only.

`method=None` picks "cupti" on NVIDIA GPUs when CUPTI loads, else "wallclock".
"""

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from tokamax._src import device

Mode = Literal["forward", "forward_res", "vjp", "forward_and_vjp"]
Method = Literal["wallclock", "cupti"]
MODES = ("forward", "forward_res", "vjp", "forward_and_vjp")


@dataclasses.dataclass(frozen=True)
class BenchmarkData:
  """Timings of one benchmarked function.

  Attributes:
    compile_time_ms: Time of `Lowered.compile()`.
    lower_time_ms: Time of `jit(f).lower(args)` (tracing included).
    evaluation_times_ms: One time per timed run.
    peak_memory_bytes: Device memory of one run as XLA plans it (arguments,
      outputs and temporaries, less aliased buffers); None if unknown.
    metadata: The timing method, device kind, iterations and so on.
  """

  compile_time_ms: float
  lower_time_ms: float
  evaluation_times_ms: tuple[float, ...]
  peak_memory_bytes: int | None = None
  metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def median_evaluation_time_ms(self) -> float:
    return float(np.median(self.evaluation_times_ms))

  def asdict(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out["metadata"] = dict(self.metadata)
    out["median_evaluation_time_ms"] = self.median_evaluation_time_ms
    return out


def _is_array(x: Any) -> bool:
  return isinstance(x, jax.Array | np.ndarray | jax.ShapeDtypeStruct)


def random_array(key: jax.Array, shape, dtype) -> jax.Array:
  """Normal floats, all-True booleans, zero integers (valid as indices and sizes)."""
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)
  if dtype == jnp.bool_:
    return jnp.ones(shape, dtype)
  return jnp.zeros(shape, dtype)


def initialize(leaves: list[Any], seed: int | None) -> list[Any]:
  """`leaves` with each `jax.ShapeDtypeStruct` replaced by a `random_array`."""
  if seed is None:
    bad = [x for x in leaves if isinstance(x, jax.ShapeDtypeStruct)]
    if bad:
      raise ValueError("`seed=None` needs concrete arrays, got ShapeDtypeStructs.")
    return leaves
  root = jax.random.key(seed)
  return [
    random_array(jax.random.fold_in(root, i), x.shape, x.dtype)
    if isinstance(x, jax.ShapeDtypeStruct)
    else x
    for i, x in enumerate(leaves)
  ]


def standardize_function(
  f: Callable[..., Any],
  *args: Any,
  kwargs: Mapping[str, Any] | None = None,
  mode: Mode = "forward",
  seed: int | None = 0,
) -> tuple[Callable[[list[jax.Array]], Any], list[jax.Array]]:
  """Makes `f` a function of one list of arrays, for timing.

  Args:
    f: A JAX function.
    *args: Positional arguments of `f`; `jax.ShapeDtypeStruct` leaves get
      random values (see `random_array`), other non-array leaves stay static.
    kwargs: Keyword arguments of `f`, treated as `args`.
    mode: "forward" (the output), "forward_res" (the output and the residuals
      the backward pass needs), "vjp" (the backward pass alone, of random
      cotangents, with the residuals baked in) or "forward_and_vjp" (both
      passes, the output as its own cotangent).
    seed: Seed of the random values; None to require concrete arrays.

  Returns:
    `(fn, arrays)`: `fn(arrays)` evaluates; `arrays` are the array leaves.
  """
  if mode not in MODES:
    raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}.")
  leaves, tree = jax.tree.flatten((args, dict(kwargs or {})))
  is_array = [_is_array(x) for x in leaves]
  arrays = initialize([x for x, a in zip(leaves, is_array, strict=True) if a], seed)
  others = [x for x, a in zip(leaves, is_array, strict=True) if not a]

  def forward(arrays: list[jax.Array]) -> Any:
    it_a, it_o = iter(arrays), iter(others)
    merged = [next(it_a) if a else next(it_o) for a in is_array]
    call_args, call_kwargs = tree.unflatten(merged)
    return f(*call_args, **call_kwargs)

  if mode == "forward":
    return forward, arrays
  if mode == "forward_res":

    def forward_res(arrays):
      out, vjp_fn = jax.vjp(forward, arrays)
      return out, jax.tree.leaves(vjp_fn)

    return forward_res, arrays
  if mode == "forward_and_vjp":

    def forward_and_vjp(arrays):
      out, vjp_fn = jax.vjp(forward, arrays)
      return out, vjp_fn(out)

    return forward_and_vjp, arrays
  out, vjp_fn = jax.vjp(forward, arrays)
  out_leaves, out_tree = jax.tree.flatten(out)
  douts = initialize(
    [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in out_leaves],
    1 + (seed or 0),
  )
  return lambda douts: vjp_fn(out_tree.unflatten(douts)), douts


# -- Timers -------------------------------------------------------------------


def _wallclock_times(fn: Callable, args: Any, iterations: int) -> list[float]:
  jax.block_until_ready(fn(args))  # Warm-up.
  times = []
  for _ in range(iterations):
    start = time.perf_counter()
    jax.block_until_ready(fn(args))
    times.append((time.perf_counter() - start) * 1e3)
  return times


@functools.cache
def _cupti_profiler() -> Any | None:
  """The CUPTI profiler class, or None where it cannot load."""
  try:
    from jax._src.lib import mosaic_gpu
    from jax.experimental.mosaic.gpu import profiler
  except Exception:
    return None
  return None if mosaic_gpu is None else profiler.Cupti


def cupti_unavailable_reason() -> str | None:
  """Why `method="cupti"` cannot run here, or None."""
  if not device.is_nvidia_gpu():
    return f"CUPTI needs an NVIDIA GPU; the default backend is {jax.default_backend()}"
  if _cupti_profiler() is None:
    return "jaxlib's Mosaic GPU extension (which carries the CUPTI hooks) did not load"
  return None


def cupti_times(fn: Callable, call_args: tuple, iterations: int) -> list[float]:
  """Kernel time in ms of each of `iterations` runs of `fn(*call_args)`, after a warm-up.

  `fn` may be a plain function, a jitted one or an AOT-compiled program.
  """
  reason = cupti_unavailable_reason()
  if reason is not None:
    raise ValueError(f"method='cupti' is unavailable: {reason}.")
  # finalize=False keeps CUPTI attached between measurements (attaching is slow).
  measure = _cupti_profiler()(finalize=False).measure(fn, iterations=iterations)
  _, timings = measure(*call_args)  # Warms up once, then times `iterations` runs.
  if timings is None:  # No kernel ran.
    return [0.0] * iterations
  if iterations == 1:
    timings = [timings]
  return [float(t) for t in timings]


def _cupti_times(fn: Callable, args: Any, iterations: int) -> list[float]:
  return cupti_times(fn, (args,), iterations)


_TIMERS: dict[str, Callable[[Callable, Any, int], list[float]]] = {
  "wallclock": _wallclock_times,
  "cupti": _cupti_times,
}


def default_method() -> str:
  return "cupti" if cupti_unavailable_reason() is None else "wallclock"


def time_compiled(
  fn: Callable[[Any], Any], args: Any, *, iterations: int, method: Method | None = None
) -> list[float]:
  """Times `iterations` runs of `fn(args)` (after a warm-up), in ms."""
  if iterations < 1:
    raise ValueError(f"`iterations` must be positive, got {iterations}.")
  method = method or default_method()
  if method not in _TIMERS:
    raise ValueError(f"`method` must be one of {sorted(_TIMERS)} or None, got {method!r}.")
  return _TIMERS[method](fn, args, iterations)


def _peak_memory_bytes(compiled: jax.stages.Compiled) -> int | None:
  try:
    stats = compiled.memory_analysis()
  except Exception:
    return None
  if stats is None:
    return None
  total = (
    stats.argument_size_in_bytes
    + stats.output_size_in_bytes
    + stats.temp_size_in_bytes
    - stats.alias_size_in_bytes
  )
  return int(total)


def compile_benchmark(f: Callable[[Any], Any], args: Any) -> Callable[..., BenchmarkData]:
  """Lowers and compiles `f(args)` once; returns `run(args, iterations=, method=)`."""
  start = time.perf_counter()
  lowered = jax.jit(f).lower(args)
  lower_ms = (time.perf_counter() - start) * 1e3
  start = time.perf_counter()
  compiled = lowered.compile()
  compile_ms = (time.perf_counter() - start) * 1e3
  peak = _peak_memory_bytes(compiled)

  def run(args: Any, *, iterations: int = 10, method: Method | None = None) -> BenchmarkData:
    method = method or default_method()
    times = time_compiled(compiled, args, iterations=iterations, method=method)
    return BenchmarkData(
      compile_time_ms=compile_ms,
      lower_time_ms=lower_ms,
      evaluation_times_ms=tuple(times),
      peak_memory_bytes=peak,
      metadata={
        "method": method,
        "iterations": iterations,
        "platform": jax.default_backend(),
        "device_kind": device.default_device().device_kind,
      },
    )

  return run


def benchmark(
  f: Callable[[Any], Any],
  args: Any,
  *,
  iterations: int = 10,
  method: Method | None = None,
) -> BenchmarkData:
  """Compiles `f(args)` and times `iterations` runs after a warm-up.

  Args:
    f: A function of one argument, e.g. from `standardize_function`.
    args: Its argument (a pytree of arrays).
    iterations: Timed runs.
    method: "wallclock", "cupti" (kernel time only; NVIDIA GPUs) or None for
      the best method available.

  Returns:
    The `BenchmarkData`.
  """
  return compile_benchmark(f, args)(args, iterations=iterations, method=method)
