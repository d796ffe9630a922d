"""Hypothesis property tests: random shapes and feature flags, every implementation that runs here.

Profiles: `harness-ci` (derandomized, 12 examples, no deadline; the default) and
`harness-nightly` (200 examples): `--hypothesis-profile harness-nightly` or
`TOKAMAX_HYPOTHESIS_PROFILE=harness-nightly`.
"""

import hypothesis
from hypothesis import strategies as st

from suites import matrices, opdb
from suites.matrices import checks
from tokamax_harness import hardware


def _native(op):
  return [
    i for i in matrices.all_for(opdb.get(op).spec) if i.instance is not None and not i.interpret
  ]


@st.composite
def _calls(draw):
  op = draw(st.sampled_from(opdb.OPS))
  shape = draw(opdb.get(op).sizes())
  feature = draw(st.sampled_from(list(opdb.get(op).features)))
  dtype = draw(st.sampled_from(["float32", "bfloat16"]))
  impl = draw(st.sampled_from(_native(op)))
  case = matrices.Case(op, tuple(sorted(shape.items())), dtype, feature, hardware.detect().family)
  return case, impl


@hypothesis.given(_calls())
def test_matches_reference(call):
  case, impl = call
  hypothesis.note(f"{case.op}[{impl.name}] {case.id}")
  try:
    checks.check_forward(case, impl)
  except Exception as e:
    if type(e).__name__ == "Skipped":  # Unsupported for this call: nothing to check.
      hypothesis.reject()
    raise
