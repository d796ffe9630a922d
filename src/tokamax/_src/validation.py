"""Argument checks that name the argument and what was expected."""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def as_array(name: str, value: Any) -> jax.Array:
  if value is None:
    raise TypeError(f"`{name}` must be an array, got None.")
  if not hasattr(value, "shape") or not hasattr(value, "dtype"):
    try:
      value = jnp.asarray(value)
    except TypeError as e:
      raise TypeError(f"`{name}` must be an array, got {type(value).__name__}.") from e
  return value


def floating(name: str, value: Any) -> jax.Array:
  """`value` as an array of a floating dtype."""
  value = as_array(name, value)
  if not jnp.issubdtype(value.dtype, jnp.floating):
    raise TypeError(f"`{name}` must have a floating dtype, got {value.dtype}.")
  return value


def integer(name: str, value: Any) -> jax.Array:
  """`value` as an array of an integer dtype."""
  value = as_array(name, value)
  if not jnp.issubdtype(value.dtype, jnp.integer):
    raise TypeError(f"`{name}` must have an integer dtype, got {value.dtype}.")
  return value


def concrete_within(name: str, value: Any, low: int, high: int | None = None) -> None:
  """Raises if concrete `value` holds an element outside [low, high) (no upper bound where
  `high` is None). A traced value cannot be read when the call is made and passes."""
  if isinstance(value, jax.core.Tracer) or not np.size(value):
    return
  values = np.asarray(value)
  smallest, largest = values.min(), values.max()
  if smallest < low or (high is not None and largest >= high):
    span = f"[{low}, {high})" if high is not None else f"[{low}, inf)"
    raise ValueError(f"`{name}` must lie in {span}, got [{smallest}, {largest}].")


def finite(name: str, value: Any) -> float:
  """`value` (a real number, not a bool or a string) as a finite float."""
  if isinstance(value, bool | np.bool_ | str | bytes):
    raise TypeError(f"`{name}` must be a number, got {value!r}.")
  try:
    number = float(value)
  except (TypeError, ValueError) as e:
    raise TypeError(f"`{name}` must be a number, got {value!r}.") from e
  if not np.isfinite(number):
    raise ValueError(f"`{name}` must be finite, got {value!r}.")
  return number


def flag(name: str, value: Any) -> bool:
  """`value` as a bool: bools, NumPy bools, 0 and 1 only (a truthy "no" is refused)."""
  if isinstance(value, bool) or (isinstance(value, int | np.integer) and value in (0, 1)):
    return bool(value)
  if getattr(value, "dtype", None) == np.bool_ and np.shape(value) == ():
    return bool(value)  # NumPy bools and concrete 0-d boolean arrays.
  raise TypeError(f"`{name}` must be a bool, got {value!r}.")


def dtype(name: str, value: Any) -> np.dtype:
  """`value` as a NumPy dtype (ml_dtypes' too)."""
  try:
    return np.dtype(value)
  except TypeError as e:
    raise TypeError(f"`{name}` must be a dtype, got {value!r}.") from e


def rank(name: str, value: Any, expected: int | Sequence[int], layout: str = "") -> None:
  expected = (expected,) if isinstance(expected, int) else tuple(expected)
  if np.ndim(value) not in expected:
    what = " or ".join(map(str, expected))
    hint = f" ({layout})" if layout else ""
    raise ValueError(f"`{name}` must have rank {what}{hint}, got shape {np.shape(value)}.")


def min_rank(name: str, value: Any, minimum: int, layout: str = "") -> None:
  if np.ndim(value) < minimum:
    hint = f" ({layout})" if layout else ""
    raise ValueError(f"`{name}` must have rank >= {minimum}{hint}, got shape {np.shape(value)}.")


def same_dtype(**arrays: Any) -> None:
  dtypes = {name: a.dtype for name, a in arrays.items() if a is not None}
  if len(set(dtypes.values())) > 1:
    listed = ", ".join(f"`{n}`: {d}" for n, d in dtypes.items())
    raise TypeError(f"Expected one dtype for {', '.join(dtypes)}; got {listed}.")


def broadcastable(name: str, shape: Sequence[int], target: Sequence[int], layout: str) -> None:
  """Checks that `shape` broadcasts to `target` without growing its rank past it."""
  if len(shape) > len(target) or any(
    s not in (1, t) for s, t in zip(shape[::-1], target[::-1], strict=False)
  ):
    raise ValueError(
      f"`{name}` of shape {tuple(shape)} does not broadcast to {tuple(target)} ({layout})."
    )


def precision(value: Any) -> Any:
  """A canonical, hashable precision."""
  if value is None or isinstance(value, jax.lax.Precision | str):
    return None if value is None else _one_precision(value)
  if isinstance(value, tuple) and len(value) == 2:
    return tuple(None if p is None else _one_precision(p) for p in value)
  raise ValueError(f"`precision` must be None, a jax.lax.Precision or a pair, got {value!r}.")


def _one_precision(value: Any) -> jax.lax.Precision:
  try:
    return jax.lax.Precision(value)
  except ValueError as e:
    names = ", ".join(repr(p.name.lower()) for p in jax.lax.Precision)
    raise ValueError(
      f"`precision` must be a jax.lax.Precision or one of {names}, got {value!r}."
    ) from e
