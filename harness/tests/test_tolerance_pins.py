"""The tolerance policy pinned: every row and rule, just below and just above its bound.

The numbers below are written out here, not read from `tokamax_harness.tolerance`:
an error of 0.9x a row's bound must pass and one of 1.1x must fail, so a row
loosened (or tightened) by more than 10% fails a test here. The same goes for
the reduction-length scaling, the fraction rule (99% within the bound, all
within 4x), the gradient factor, the accelerator float32-matmul rows and the
16-bit relative rule (k = 2 times the plain computation's error plus a floor
of 2 ulps of the reference's magnitude times L^(1/4)).
"""

import dataclasses
import math

import numpy as np
import pytest

from tokamax_harness import compare

BELOW, ABOVE = 0.9, 1.1
FRACTION = 0.99
OUTLIER = 4.0
K = 2.0
FLOOR_ULPS = 2.0
GRADIENT = 2.0
ULP = {"bfloat16": 2.0**-7, "float16": 2.0**-10}


@dataclasses.dataclass(frozen=True)
class Row:
  """One row of the policy as the policy is looked up."""

  id: str
  dtype: str
  atol: float
  rtol: float
  platform: str = "cpu"
  has_matmul: bool = False
  gradient: bool = False

  def bound(self, expected, reduction_length: int = 1):
    return self.atol * math.sqrt(reduction_length) + self.rtol * np.abs(expected)

  def check(self, actual, expected, *, reduction_length: int = 1, plain=None):
    return compare.assert_close(
      actual,
      expected,
      dtype=self.dtype,
      reduction_length=reduction_length,
      plain=plain,
      platform=self.platform,
      has_matmul=self.has_matmul,
      gradient=self.gradient,
      name="pinned",
    )


_FORWARD = [
  Row("float64", "float64", 1e-13, 1e-12),
  Row("float32", "float32", 2e-6, 1e-5),
  Row("bfloat16", "bfloat16", 2e-3, 1.6e-2),
  Row("float16", "float16", 2.5e-4, 2e-3),
  Row("float32-matmul-cpu", "float32", 2e-6, 1e-5, has_matmul=True),
  Row("float32-matmul-gpu", "float32", 5e-4, 2e-3, platform="gpu", has_matmul=True),
  Row("float32-matmul-tpu", "float32", 2e-3, 1.6e-2, platform="tpu", has_matmul=True),
  Row("float32-gpu-no-matmul", "float32", 2e-6, 1e-5, platform="gpu"),
  Row("float32-tpu-no-matmul", "float32", 2e-6, 1e-5, platform="tpu"),
  # Only float32 matmuls run at reduced precision by default; the other dtypes' matmuls keep
  # their own rows (and the 16-bit ones the relative rule) on accelerators.
  Row("float64-matmul-gpu", "float64", 1e-13, 1e-12, platform="gpu", has_matmul=True),
  Row("bfloat16-matmul-gpu", "bfloat16", 2e-3, 1.6e-2, platform="gpu", has_matmul=True),
  Row("float64-matmul-tpu", "float64", 1e-13, 1e-12, platform="tpu", has_matmul=True),
  Row("float16-matmul-tpu", "float16", 2.5e-4, 2e-3, platform="tpu", has_matmul=True),
]
ROWS = _FORWARD + [
  dataclasses.replace(
    r, id=f"{r.id}-gradient", atol=GRADIENT * r.atol, rtol=GRADIENT * r.rtol, gradient=True
  )
  for r in _FORWARD
]
ROW_IDS = [r.id for r in ROWS]


def _signs(n: int, seed: int = 0) -> np.ndarray:
  return np.where(np.random.default_rng(seed).random(n) < 0.5, -1.0, 1.0)


def _planted(row: Row, expected: np.ndarray, factor: float, reduction_length: int = 1):
  return expected + factor * row.bound(expected, reduction_length) * _signs(expected.size)


@pytest.mark.parametrize("reduction_length", [1, 16])
@pytest.mark.parametrize("row", ROWS, ids=ROW_IDS)
def test_absolute_bound(row, reduction_length):
  """A zero reference: only atol * sqrt(L) applies."""
  e = np.zeros(200)
  row.check(_planted(row, e, BELOW, reduction_length), e, reduction_length=reduction_length)
  with pytest.raises(AssertionError, match="exceed the bound"):
    row.check(_planted(row, e, ABOVE, reduction_length), e, reduction_length=reduction_length)


@pytest.mark.parametrize("row", ROWS, ids=ROW_IDS)
def test_relative_bound(row):
  """A large reference: rtol * |ref| is 1000x atol."""
  e = 1000.0 * row.atol / row.rtol * (1.0 + np.linspace(0.0, 1.0, 200)) * _signs(200, 1)
  row.check(_planted(row, e, BELOW), e)
  with pytest.raises(AssertionError, match="exceed the bound"):
    row.check(_planted(row, e, ABOVE), e)


@pytest.mark.parametrize("row", ROWS, ids=ROW_IDS)
def test_fraction_rule(row):
  """1% of the elements may exceed the bound, by less than 4x; not one more, not by more."""
  n = 1000
  allowed = round((1.0 - FRACTION) * n)  # 10
  e = np.ones(n)
  unit = row.bound(e) * _signs(n, 2)

  def with_off(count: int, factor: float):
    return e + np.where(np.arange(n) < count, factor, 0.5) * unit

  row.check(with_off(allowed, 0.99 * OUTLIER), e)
  with pytest.raises(AssertionError, match="exceed the bound") as failure:
    row.check(with_off(allowed + 1, 1.5), e)
  assert "x the bound" not in str(failure.value)
  with pytest.raises(AssertionError, match=f"exceed {OUTLIER:g}x the bound"):
    row.check(with_off(1, 1.01 * OUTLIER), e)


_SIXTEEN = [r for r in ROWS if r.dtype in ULP]


@pytest.mark.parametrize("row", _SIXTEEN, ids=[r.id for r in _SIXTEEN])
@pytest.mark.parametrize("plain_error", [0.0, 4e-4])
def test_relative_rule(row, plain_error):
  """16-bit: max error <= K x the plain computation's + FLOOR_ULPS ulps of max |ref| x L^(1/4)."""
  n, length = 200, 4
  magnitude = 0.01
  e = magnitude * np.linspace(0.5, 1.0, n) * _signs(n, 3)
  plain_error = plain_error * row.atol / 2e-3  # Scaled to the row.
  plain = e.copy()
  plain[7] += plain_error
  allowed = K * plain_error + FLOOR_ULPS * ULP[row.dtype] * magnitude * length**0.25
  # The table's bound is not what binds here.
  assert ABOVE * allowed < row.bound(0.0, length) / 2

  def with_error(factor):
    a = e.copy()
    a[11] += factor * allowed
    return a

  row.check(with_error(BELOW), e, reduction_length=length, plain=plain)
  row.check(with_error(ABOVE), e, reduction_length=length)  # No plain: no rule.
  with pytest.raises(AssertionError, match="relative rule"):
    row.check(with_error(ABOVE), e, reduction_length=length, plain=plain)


_WIDE = [r for r in ROWS if r.dtype not in ULP]


@pytest.mark.parametrize("row", _WIDE, ids=[r.id for r in _WIDE])
def test_no_relative_rule_for_wide_dtypes(row):
  """float32 and float64 rely on the table: a plain computation exact to the bit changes nothing."""
  e = np.linspace(-1.0, 1.0, 200)
  a = _planted(row, e, BELOW)
  row.check(a, e, plain=e)
