"""Where the benchmarks read their cases and implementations: the one adapter to the op database.

Every benchmark module (`bench.history`, `bench.run`) reads cases through these
functions only, so that moving the case source (today `suites.matrices` and
`golden`) changes this file alone.
"""

from collections.abc import Sequence

import jax

from golden import golden
from harness import hardware
from suites import matrices
from suites.matrices import checks

BenchCase = matrices.BenchCase
Case = matrices.Case
Implementation = matrices.Implementation

# The ops, in the order the benchmarks run them.
OPS: Sequence[str] = matrices.OPS


def bench_cases(family: str, *, op: str | None = None) -> list[BenchCase]:
  """The benchmark cases (case and mode) of `family`, optionally of one op."""
  return matrices.bench_cases(family, op=op)


def implementations(op: str, profile: hardware.Profile) -> list[Implementation]:
  """The op's native implementations here, in `SPEC.implementations` order (or why not)."""
  return golden.implementations(op, profile)


def case_key(case: Case) -> jax.Array:
  """The random key of a case's inputs (the same in every run)."""
  return checks.case_key(case)


def small(case: Case) -> Case:
  """`case` at its op's small golden shape (where numerics drift is measured)."""
  return golden.at_golden_shape(case)
