"""Benchmarking (in progress: see issue 7)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class BenchmarkData:
  """Timings of one benchmarked function."""

  median_evaluation_time_ms: float


def standardize_function(f, *args, kwargs=None, mode="forward", seed=0):
  raise NotImplementedError("standardize_function is not implemented yet.")


def benchmark(f, args, iterations=10, method=None):
  raise NotImplementedError("benchmark is not implemented yet.")
