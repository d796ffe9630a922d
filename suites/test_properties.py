"""Hypothesis property tests: random shapes and feature flags, every implementation that runs here.

Profiles: `ci` (derandomized, 12 examples, no deadline; the default) and
`nightly` (200 examples): `--hypothesis-profile nightly` or
`TOKAMAX_HYPOTHESIS_PROFILE=nightly`.
"""

import hypothesis
from hypothesis import strategies as st

from harness import hardware
from suites import matrices
from suites.matrices import checks, ops

_SIZES = {
  "dot_product_attention": lambda: st.fixed_dictionaries(
    dict(
      b=st.integers(1, 2),
      t=st.integers(1, 40),
      s=st.integers(1, 40),
      h=st.sampled_from([8, 16, 32]),
    )
  ).flatmap(
    lambda d: st.sampled_from([(1, 1), (2, 1), (4, 2), (2, 2)]).map(
      lambda nk: {**d, "n": nk[0], "k": nk[1]}
    )
  ),
  "layer_norm": lambda: st.fixed_dictionaries(
    dict(rows=st.tuples(st.integers(1, 6)), d=st.integers(1, 300))
  ),
  "gated_linear_unit": lambda: st.fixed_dictionaries(
    dict(m=st.integers(1, 40), k=st.integers(1, 80), n=st.integers(1, 80))
  ),
  "ragged_dot": lambda: st.fixed_dictionaries(
    dict(m=st.integers(8, 80), k=st.integers(1, 48), n=st.integers(1, 48), g=st.integers(3, 6))
  ),
  "linear_softmax_cross_entropy_loss": lambda: st.fixed_dictionaries(
    dict(b=st.integers(1, 24), h=st.integers(1, 48), v=st.integers(2, 700))
  ),
}


def _native(op):
  return [
    i for i in matrices.all_for(ops.spec_of(op)) if i.instance is not None and not i.interpret
  ]


@st.composite
def _calls(draw):
  op = draw(st.sampled_from(ops.OPS))
  shape = draw(_SIZES[op]())
  feature = draw(st.sampled_from(list(ops.BUILDERS[op].features)))
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
