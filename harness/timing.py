"""Device time of a function: the median of many runs over rotated inputs.

On GPU the time comes from the profiler's device trace (CUPTI): the duration of
each XLA module execution on the device. Elsewhere, or where the trace has no
device events, it is the wallclock around `jax.block_until_ready` after
warm-up.
"""

import dataclasses
import glob
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence

import jax

CUPTI = "cupti"
WALLCLOCK = "wallclock"


@dataclasses.dataclass(frozen=True)
class Timing:
  """Per-run device times in seconds, and how they were measured."""

  times_s: tuple[float, ...]
  method: str

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
    }


def _run(fn: Callable, args) -> None:
  jax.block_until_ready(fn(*args))


def wallclock_times(fn: Callable, args_list: Sequence[tuple], iterations: int) -> list[float]:
  times = []
  for i in range(iterations):
    args = args_list[i % len(args_list)]
    start = time.perf_counter()
    _run(fn, args)
    times.append(time.perf_counter() - start)
  return times


def _device_module_events(trace_dir: str) -> list[tuple[int, int]] | None:
  """(start_ns, duration_ns) of every XLA module run on device 0, or None."""
  files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
  if not files:
    return None
  data = jax.profiler.ProfileData.from_file(files[0])
  for plane in data.planes:
    if not plane.name.startswith("/device:") or plane.name.startswith("/device:CUSTOM"):
      continue
    if not plane.name.endswith(":0"):
      continue
    for line in plane.lines:
      if line.name == "XLA Modules":
        return sorted((int(e.start_ns), int(e.duration_ns)) for e in line.events)
  return None


def cupti_times(fn: Callable, args_list: Sequence[tuple], iterations: int) -> list[float] | None:
  """Per-run device times from a profiler trace, or None where there are none.

  Each run is separated from the next by `block_until_ready`, so the module
  executions fall into `iterations` equal groups in time order.
  """
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    try:
      for i in range(iterations):
        _run(fn, args_list[i % len(args_list)])
    finally:
      jax.profiler.stop_trace()
    events = _device_module_events(trace_dir)
  if not events or len(events) % iterations:
    return None
  per_run = len(events) // iterations
  times = []
  for i in range(iterations):
    group = events[i * per_run : (i + 1) * per_run]
    times.append(sum(d for _, d in group) * 1e-9)
  return times


def device_time(
  fn: Callable,
  args_list: Sequence[tuple],
  *,
  warmup: int = 3,
  iterations: int = 30,
  method: str = "auto",
) -> Timing:
  """Times `fn(*args)` over `args_list`, rotating through it.

  Args:
    fn: Usually a jitted function.
    args_list: Several argument tuples of the same shapes (distinct buffers,
      so that caches do not flatter); used in turn.
    warmup: Untimed runs first (compilation, autotuning).
    iterations: Timed runs; the median is reported.
    method: "cupti", "wallclock", or "auto" (the device trace on GPU, falling
      back to wallclock where it has no device events).

  Returns:
    The timing.
  """
  if not args_list:
    raise ValueError("`args_list` must hold at least one argument tuple.")
  args_list = [a if isinstance(a, tuple) else (a,) for a in args_list]
  for i in range(max(warmup, 1)):
    _run(fn, args_list[i % len(args_list)])
  if method == "auto":
    method = CUPTI if jax.default_backend() == "gpu" else WALLCLOCK
  if method == CUPTI:
    try:
      times = cupti_times(fn, args_list, iterations)
    except Exception:  # A profiler that cannot start: measure on the host instead.
      times = None
    if times is not None:
      return Timing(tuple(times), CUPTI)
    method = WALLCLOCK
  if method != WALLCLOCK:
    raise ValueError(f"unknown timing method {method!r}.")
  return Timing(tuple(wallclock_times(fn, args_list, iterations)), WALLCLOCK)
