"""The benchmark anchors (functions outside the library timed beside it) compute the op: each
agrees with the op's independent reference on the features the benchmarks time."""

import dataclasses

import jax.numpy as jnp
import pytest

from golden import golden
from suites import opdb
from suites.matrices import checks
from tokamax_harness import compare


def _cases():
  out = []
  for op in opdb.OPS:
    info = opdb.get(op)
    features = {call.feature for calls in info.bench.values() for call in calls}
    f32 = [c for c in golden.cases("cpu", [op]) if c.dtype == "float32"]
    # Features only benchmarks use (bias and mask planes) at the golden shape.
    bench_only = [dataclasses.replace(f32[0], feature=f) for f in sorted(info.bench_features)]
    for case in [c for c in f32 if c.feature in features] + bench_only:
      for name, anchor in info.anchors.items():
        out.append(pytest.param(case, anchor, id=f"{op}-{name}-{case.id}"))
  return out


@pytest.mark.parametrize(("case", "anchor"), _cases())
def test_anchor_matches_the_reference(case, anchor):
  args, kwargs = case.make_args(checks.case_key(case))
  out = case.call(lambda *a, **k: anchor(a, k), args, kwargs)
  compare.assert_close(
    out,
    case.reference(args, kwargs),
    dtype=jnp.float32,
    reduction_length=case.reduction_length,
    has_matmul=case.has_matmul,
    name=f"{case.op} anchor",
  )
