"""Device time of a function: the median of many runs over rotated inputs.

On NVIDIA GPUs the time is the kernel time that CUPTI reports (through
`tokamax.benchmarking`'s timer). Elsewhere, or where CUPTI cannot load, it is
the wallclock around `jax.block_until_ready` after warm-up, or with
`method="cputime"` the process's CPU time around it (all its threads; on a
shared CPU host a busy neighbour stretches wallclock, not the CPU time spent).
"""

import dataclasses
import math
import statistics
import time
import warnings
from collections.abc import Callable, Sequence

import jax

CUPTI = "cupti"
WALLCLOCK = "wallclock"
CPUTIME = "cputime"  # The process's CPU time: wallclock less the time other processes took.
MAX_ITERATIONS = 2000  # The most wallclock iterations `min_seconds` asks for.


@dataclasses.dataclass(frozen=True)
class Timing:
  """Per-run device times in seconds, and how they were measured."""

  times_s: tuple[float, ...]
  method: str
  # Why a CUPTI measurement fell back to wallclock, if it did.
  fallback_reason: str | None = None

  @property
  def median_s(self) -> float:
    return statistics.median(self.times_s)

  @property
  def median_ms(self) -> float:
    return 1e3 * self.median_s

  @property
  def min_s(self) -> float:
    return min(self.times_s)

  def as_dict(self) -> dict:
    return {
      "median_ms": self.median_ms,
      "min_ms": 1e3 * self.min_s,
      "max_ms": 1e3 * max(self.times_s),
      "runs": len(self.times_s),
      "method": self.method,
      "fallback_reason": self.fallback_reason,
    }


def _run(fn: Callable, args) -> None:
  jax.block_until_ready(fn(*args))


def wallclock_times(
  fn: Callable, args_list: Sequence[tuple], iterations: int, clock: Callable = time.perf_counter
) -> list[float]:
  times = []
  for i in range(iterations):
    args = args_list[i % len(args_list)]
    start = clock()
    _run(fn, args)
    times.append(clock() - start)
  return times


def cupti_times(fn: Callable, args_list: Sequence[tuple], iterations: int) -> list[float] | None:
  """Per-run kernel times from CUPTI (tokamax's `method="cupti"` timer), or None.

  Runs are spread evenly over the argument tuples, so caches do not flatter.
  """
  try:  # tokamax's CUPTI profiler; without tokamax installed, wallclock instead.
    from tokamax._src import benchmarking
  except ImportError:
    return None
  if benchmarking.cupti_unavailable_reason() is not None:
    return None
  per_args = max(1, iterations // len(args_list))
  times = []
  for args in args_list:
    times.extend(t * 1e-3 for t in benchmarking.cupti_times(fn, args, per_args))
  return times


def device_time(
  fn: Callable,
  args_list: Sequence[tuple],
  *,
  warmup: int = 3,
  iterations: int = 30,
  method: str = "auto",
  min_seconds: float = 0.0,
) -> Timing:
  """Times `fn(*args)` over `args_list`, rotating through it.

  Args:
    fn: Usually a jitted function.
    args_list: Several argument tuples of the same shapes (distinct buffers,
      so that caches do not flatter); used in turn.
    warmup: Untimed runs first (compilation, autotuning).
    iterations: Timed runs; the median is reported.
    method: "cupti", "wallclock", "cputime" (the process's CPU time, for a
      CPU backend on a shared host), or "auto" (CUPTI on GPU, falling back to
      wallclock, with the reason kept in `Timing.fallback_reason`).
    min_seconds: Wallclock and CPU time only: more iterations (up to MAX_ITERATIONS) where
      `iterations` calls would take less, so that short calls get enough
      samples for a stable median and minimum.

  Returns:
    The timing.
  """
  if not args_list:
    raise ValueError("`args_list` must hold at least one argument tuple.")
  args_list = [a if isinstance(a, tuple) else (a,) for a in args_list]
  for i in range(max(warmup, 1)):
    start = time.perf_counter()
    _run(fn, args_list[i % len(args_list)])
    last = time.perf_counter() - start
  if method == "auto":
    method = CUPTI if jax.default_backend() == "gpu" else WALLCLOCK
  reason = None
  if method == CUPTI:
    try:
      times = cupti_times(fn, args_list, iterations)
      reason = None if times is not None else "CUPTI is unavailable here"
    except Exception as e:  # A profiler that cannot start: measure on the host instead.
      times, reason = None, f"{type(e).__name__}: {e}"[:300]
    if times is not None:
      return Timing(tuple(times), CUPTI)
    warnings.warn(f"device_time fell back to wallclock: {reason}", stacklevel=2)
    method = WALLCLOCK
  if method not in (WALLCLOCK, CPUTIME):
    raise ValueError(f"unknown timing method {method!r}.")
  if min_seconds > 0 and last > 0:
    iterations = max(iterations, min(MAX_ITERATIONS, math.ceil(min_seconds / last)))
  clock = time.process_time if method == CPUTIME else time.perf_counter
  return Timing(tuple(wallclock_times(fn, args_list, iterations, clock)), method, reason)
