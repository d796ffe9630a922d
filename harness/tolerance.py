"""The one tolerance policy: a table per dtype, scaled by the reduction length.

An element passes when `|actual - expected| <= atol * sqrt(L) + rtol * |expected|`,
L being the length of the reduction that produced it (1 where there is none).
A comparison passes when at least `fraction` of the elements pass that bound
and all of them pass `outlier_factor` times it. Where a plain computation in
the input dtype is available, the relative rule also applies: the kernel's
max error against the high-precision reference is at most `k` times the plain
computation's max error, plus a rounding floor of `floor_ulps` ulps of the
reference's magnitude times L^(1/4). The rule applies to the 16-bit dtypes,
where a plain computation is meaningfully worse than a careful one; float32
and float64 rely on the table (on accelerators a plain float32 matmul runs at
reduced precision, so it is no baseline).
"""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Tolerance:
  """Bounds for one dtype.

  Attributes:
    atol: Absolute bound at reduction length 1; scaled by sqrt(L).
    rtol: Bound relative to |expected|.
    fraction: Fraction of elements that must lie within the bound.
    outlier_factor: Every element must lie within this multiple of the bound.
    k: The relative rule's factor on the plain computation's error.
    floor_ulps: The relative rule's rounding floor, in ulps of max |expected|.
    relative_rule: Whether the relative rule applies.
  """

  atol: float
  rtol: float
  fraction: float = 0.99
  outlier_factor: float = 4.0
  k: float = 2.0
  floor_ulps: float = 2.0
  relative_rule: bool = False

  def scaled(self, factor: float) -> "Tolerance":
    """The same tolerance with atol and rtol multiplied by `factor`."""
    return dataclasses.replace(self, atol=self.atol * factor, rtol=self.rtol * factor)

  def bound(self, expected: np.ndarray, reduction_length: int = 1) -> np.ndarray:
    return self.atol * math.sqrt(max(reduction_length, 1)) + self.rtol * np.abs(expected)


# Values for O(1) outputs (the matrices scale inputs so that outputs are O(1)).
# rtol is about two ulps of the dtype; atol about a quarter of that.
TABLE: dict[str, Tolerance] = {
  "float64": Tolerance(atol=1e-13, rtol=1e-12),
  "float32": Tolerance(atol=2e-6, rtol=1e-5),
  "bfloat16": Tolerance(atol=2e-3, rtol=1.6e-2, relative_rule=True),
  "float16": Tolerance(atol=2.5e-4, rtol=2e-3, relative_rule=True),
}

# float32 matmuls on accelerators run at reduced precision by default
# (TF32 on NVIDIA GPUs, bfloat16 passes on TPU).
ACCELERATOR_FLOAT32_MATMUL = Tolerance(atol=5e-4, rtol=2e-3)
TPU_FLOAT32_MATMUL = dataclasses.replace(TABLE["bfloat16"], relative_rule=False)

# Gradients go through more roundings than the forward pass.
GRADIENT_FACTOR = 2.0


def eps(dtype) -> float:
  return float(jnp.finfo(dtype).eps)


def for_dtype(
  dtype, *, platform: str = "cpu", has_matmul: bool = False, gradient: bool = False
) -> Tolerance:
  """The tolerance for results in `dtype` computed on `platform`.

  Args:
    dtype: The dtype the computation was done in.
    platform: "cpu", "gpu" or "tpu".
    has_matmul: Whether the computation has matmuls, whose float32 default
      precision is reduced on accelerators.
    gradient: Whether the values are gradients (a looser bound).

  Returns:
    The tolerance.
  """
  name = np.dtype(dtype).name
  if name not in TABLE:
    raise KeyError(f"no tolerance for dtype {name}; the table has {sorted(TABLE)}.")
  tol = TABLE[name]
  if name == "float32" and has_matmul and platform == "gpu":
    tol = ACCELERATOR_FLOAT32_MATMUL
  elif name == "float32" and has_matmul and platform == "tpu":
    tol = TPU_FLOAT32_MATMUL
  return tol.scaled(GRADIENT_FACTOR) if gradient else tol
