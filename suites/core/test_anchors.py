"""The benchmark anchors (functions outside the library timed beside it) compute the op: each
agrees with the op's independent reference on the features the benchmarks time."""

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
    for case in golden.cases("cpu", [op]):
      if case.dtype != "float32" or case.feature not in features:
        continue
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
