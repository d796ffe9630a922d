"""Comparators: a kernel's result against a high-precision reference.

`assert_close` applies the tolerance policy of `harness.tolerance` to arrays
or pytrees of arrays and fails with a report that names the max and mean
error, how many elements are off and where, and the NaN and Inf counts.
"""

import dataclasses

import jax
import numpy as np

from . import tolerance as tolerance_lib

MAX_INDICES = 5


@dataclasses.dataclass(frozen=True)
class Report:
  """The outcome of one comparison; `ok` is False with a readable `message`."""

  name: str
  ok: bool
  max_error: float
  mean_error: float
  num_off: int
  size: int
  message: str


def _as_f64(x) -> np.ndarray:
  return np.asarray(x).astype(np.float64)


def _nonfinite_mismatch(a: np.ndarray, e: np.ndarray) -> np.ndarray:
  """Where `a` and `e` are not the same non-finite value although one is non-finite."""
  same = (a == e) | (np.isnan(a) & np.isnan(e))
  return (~np.isfinite(a) | ~np.isfinite(e)) & ~same


def relative_error(actual, expected) -> float:
  """||actual - expected|| / ||expected|| in float64.

  Inf where either side is non-finite and the other is not the same value;
  elements where both hold the same NaN or Inf count as equal.
  """
  a, e = _as_f64(actual), _as_f64(expected)
  if a.shape != e.shape or _nonfinite_mismatch(a, e).any():
    return float("inf")
  finite = np.isfinite(e)
  a, e = np.where(finite, a, 0.0), np.where(finite, e, 0.0)
  return float(np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30))


def _nonfinite(x: np.ndarray) -> str:
  return f"NaN {int(np.isnan(x).sum())}, Inf {int(np.isinf(x).sum())}"


def _indices(mask: np.ndarray, limit: int = MAX_INDICES) -> list[tuple[int, ...]]:
  flat = np.flatnonzero(mask)[:limit]
  return [tuple(int(i) for i in np.unravel_index(f, mask.shape)) for f in flat]


def compare(
  actual,
  expected,
  *,
  tol: tolerance_lib.Tolerance,
  reduction_length: int = 1,
  plain=None,
  dtype=None,
  name: str = "output",
) -> Report:
  """Compares one array with its reference under `tol`.

  Args:
    actual: The result under test.
    expected: The high-precision reference.
    tol: The tolerance.
    reduction_length: The length of the reduction behind each element.
    plain: The same computation done plainly in the input dtype; enables the
      relative rule where `tol.relative_rule` says it applies.
    dtype: The dtype of the computation, for the rounding floor (default:
      `actual`'s).
    name: Used in the report.

  Returns:
    The report.
  """
  a, e = _as_f64(actual), _as_f64(expected)
  if a.shape != e.shape:
    msg = f"{name}: shape {a.shape} differs from the reference's {e.shape}"
    return Report(name, False, np.inf, np.inf, a.size, a.size, msg)
  size = a.size
  if size == 0:
    return Report(name, True, 0.0, 0.0, 0, 0, f"{name}: empty")
  finite_e = np.isfinite(e)
  # Non-finite values pass only where the reference has the same value.
  same_nonfinite = ~finite_e & ((a == e) | (np.isnan(a) & np.isnan(e)))
  with np.errstate(invalid="ignore"):
    err = np.where(finite_e & np.isfinite(a), np.abs(a - e), np.inf)
  err = np.where(same_nonfinite, 0.0, err)
  bound = tol.bound(np.where(finite_e, e, 0.0), reduction_length)
  off = err > bound
  outliers = err > tol.outlier_factor * bound
  num_off = int(off.sum())
  finite_err = err[np.isfinite(err)]
  max_err = float(err.max())
  mean_err = float(finite_err.mean()) if finite_err.size else np.inf
  problems = []
  # NaN or Inf against anything else fails by itself, whatever the tolerance.
  mismatch = _nonfinite_mismatch(a, e)
  if mismatch.any():
    problems.append(
      f"{int(mismatch.sum())} elements are NaN or Inf on one side only (or Infs of opposite "
      f"sign), first at {_indices(mismatch)}"
    )
  if num_off > (1.0 - tol.fraction) * size:
    problems.append(
      f"{num_off} of {size} elements ({100.0 * num_off / size:.3g}%) exceed the bound; "
      f"at most {100.0 * (1 - tol.fraction):.3g}% may"
    )
  if outliers.any():
    problems.append(
      f"{int(outliers.sum())} elements exceed {tol.outlier_factor:g}x the bound; none may"
    )
  if plain is not None and tol.relative_rule:
    p = _as_f64(plain)
    plain_err = float(np.nanmax(np.where(finite_e, np.abs(p - e), 0.0)))
    magnitude = float(np.max(np.abs(np.where(finite_e, e, 0.0))))
    ulp = _ulp_of(actual if dtype is None else dtype)
    # L^(1/4), not sqrt(L): with sqrt(L) the floor reached 37% of the magnitude at L = 576
    # in bfloat16, and a gradient scaled by 0.78 passed the matrix.
    floor = tol.floor_ulps * ulp * magnitude * max(reduction_length, 1) ** 0.25
    allowed = tol.k * plain_err + floor
    if not max_err <= allowed:
      problems.append(
        f"relative rule: max error {max_err:.3g} > {tol.k:g} x plain-dtype error "
        f"{plain_err:.3g} + floor {floor:.3g} = {allowed:.3g}"
      )
  worst = np.unravel_index(int(np.argmax(np.where(np.isnan(err), np.inf, err))), err.shape)
  lines = [
    f"{name}: shape {a.shape}, bound atol={tol.atol:.3g}*sqrt(L={reduction_length}) "
    f"+ rtol={tol.rtol:.3g}*|ref|",
    f"  max abs error {max_err:.4g} at {tuple(int(i) for i in worst)} "
    f"(actual {a[worst]!r}, reference {e[worst]!r}); mean abs error {mean_err:.4g}",
    f"  elements off: {num_off} of {size}; first indices {_indices(off)}",
    f"  actual: {_nonfinite(a)}; reference: {_nonfinite(e)}",
  ]
  if problems:
    lines.insert(1, "  FAILED: " + "; ".join(problems))
  return Report(name, not problems, max_err, mean_err, num_off, size, "\n".join(lines))


def _ulp_of(x) -> float:
  return tolerance_lib.eps(x if isinstance(x, type) else getattr(x, "dtype", x))


def _leaves_with_names(tree, name: str) -> list[tuple[str, object]]:
  leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: x is None)
  return [(name + jax.tree_util.keystr(path), leaf) for path, leaf in leaves]


def assert_close(
  actual,
  expected,
  *,
  dtype=None,
  tol: tolerance_lib.Tolerance | None = None,
  reduction_length: int = 1,
  plain=None,
  platform: str | None = None,
  has_matmul: bool = False,
  gradient: bool = False,
  name: str = "output",
) -> list[Report]:
  """Asserts that `actual` (array or pytree) matches `expected` under the policy.

  Args:
    actual: The result under test.
    expected: The high-precision reference, same structure.
    dtype: The dtype the computation ran in (default: each leaf's own dtype).
    tol: An explicit tolerance (default: the policy's for `dtype`).
    reduction_length: The length of the reduction behind each element.
    plain: The same computation done plainly in the input dtype (same
      structure); enables the relative rule.
    platform: Where it ran (default: JAX's default backend).
    has_matmul: Whether float32 matmuls are involved (reduced default
      precision on accelerators).
    gradient: Whether the values are gradients.
    name: The name used in failure reports.

  Returns:
    The reports, one per leaf.

  Raises:
    AssertionError: With every failing leaf's report.
  """
  platform = platform or jax.default_backend()
  a_leaves = _leaves_with_names(actual, name)
  e_leaves = _leaves_with_names(expected, name)
  p_leaves = (
    _leaves_with_names(plain, name) if plain is not None else [(n, None) for n, _ in a_leaves]
  )
  if [n for n, _ in a_leaves] != [n for n, _ in e_leaves]:
    raise AssertionError(
      f"{name}: structure {[n for n, _ in a_leaves]} differs from {[n for n, _ in e_leaves]}"
    )
  reports = []
  for (leaf_name, a), (_, e), (_, p) in zip(a_leaves, e_leaves, p_leaves, strict=True):
    if a is None and e is None:
      continue
    if a is None or e is None:
      raise AssertionError(
        f"{leaf_name}: one side is None (actual {a is None}, reference {e is None})"
      )
    leaf_dtype = dtype if dtype is not None else np.asarray(a).dtype
    leaf_tol = tol or tolerance_lib.for_dtype(
      leaf_dtype, platform=platform, has_matmul=has_matmul, gradient=gradient
    )
    reports.append(
      compare(
        a,
        e,
        tol=leaf_tol,
        reduction_length=reduction_length,
        plain=p,
        dtype=leaf_dtype,
        name=leaf_name,
      )
    )
  failed = [r for r in reports if not r.ok]
  if failed:
    raise AssertionError("\n".join(r.message for r in failed))
  return reports


def assert_finite(x, *, name: str = "output") -> None:
  """Asserts every element of `x` (array or pytree) is finite."""
  for leaf_name, leaf in _leaves_with_names(x, name):
    if leaf is None:
      continue
    v = np.asarray(leaf).astype(np.float64)
    if not np.isfinite(v).all():
      raise AssertionError(
        f"{leaf_name}: {_nonfinite(v)} of {v.size}; first at {_indices(~np.isfinite(v))}"
      )


def assert_bitwise_equal(a, b, *, name: str = "output") -> None:
  """Asserts two results are bitwise identical (determinism)."""
  for (leaf_name, x), (_, y) in zip(
    _leaves_with_names(a, name), _leaves_with_names(b, name), strict=True
  ):
    if x is None and y is None:
      continue
    x, y = np.asarray(x), np.asarray(y)
    if x.shape != y.shape or x.dtype != y.dtype:
      raise AssertionError(f"{leaf_name}: {x.shape}/{x.dtype} vs {y.shape}/{y.dtype} between runs")
    if not np.array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8)):
      diff = x.astype(np.float64) != y.astype(np.float64)
      raise AssertionError(
        f"{leaf_name}: not deterministic; {int(diff.sum())} of {x.size} elements differ "
        f"between two runs, first at {_indices(diff)}"
      )
