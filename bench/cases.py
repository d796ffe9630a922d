"""Where the benchmarks read their cases, implementations and anchors: the one adapter to the
op database.

Every benchmark module (`bench.history`, `bench.run`) reads cases through these
functions only, so that a change of the case source (the op database
`suites.opdb`, expanded by `suites.matrices`) changes this file alone.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax

from golden import golden
from suites import matrices, opdb
from suites.matrices import checks
from tokamax_harness import hardware

BenchCase = matrices.BenchCase
Case = matrices.Case
Implementation = matrices.Implementation

# The ops, in the order the benchmarks run them.
OPS: Sequence[str] = tuple(opdb.OPS)

# Anchor: (args, kwargs) -> output, a function outside the library timed beside it.
Anchor = Callable[[tuple, dict], Any]


def bench_cases(family: str, *, op: str | None = None) -> list[BenchCase]:
  """The benchmark cases (case and mode) of `family`, optionally of one op."""
  return matrices.bench_cases(family, op=op)


def implementations(op: str, profile: hardware.Profile) -> list[Implementation]:
  """The op's native implementations here, in `SPEC.implementations` order (or why not)."""
  return golden.implementations(op, profile)


def spec(op: str) -> Any:
  """The op's `OpSpec`: calling it with `implementation=None` is what users get."""
  return opdb.get(op).spec


def anchors(op: str) -> dict[str, Anchor]:
  """Functions outside the library that the runner times beside the op (e.g. jax.lax)."""
  return dict(opdb.get(op).anchors)


def case_key(case: Case) -> jax.Array:
  """The random key of a case's inputs (the same in every run)."""
  return checks.case_key(case)


def small(case: Case) -> Case:
  """`case` at its op's small golden shape (where numerics drift is measured)."""
  return case.at_golden_shape()
