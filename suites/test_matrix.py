"""The hardware matrix: every op x implementation x case that runs here, against the references."""

import pytest

from suites.matrices import checks


@pytest.mark.matrix("forward")
def test_forward(case, impl):
  checks.check_forward(case, impl)


@pytest.mark.matrix("gradient")
def test_vjp(case, impl):
  checks.check_vjp(case, impl)


@pytest.mark.matrix("determinism")
def test_deterministic(case, impl):
  checks.check_determinism(case, impl)


@pytest.mark.matrix("determinism")
def test_finite_differences(case, impl):
  if case.dtype != "float32":
    pytest.skip("finite differences run once per case, in float32 (the float32 entry)")
  checks.check_finite_differences(case, impl)
