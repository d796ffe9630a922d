"""Concrete inputs for an abstract argument record, for timing candidates.

Float fields stay `jax.ShapeDtypeStruct`s (random normal values come from
`benchmarking.standardize_function`). Integer fields must hold valid values to
be representative: the op's spec fills its own (`OpSpec.integer_inputs`); any
other integer field gets zeros.
"""

import dataclasses
from typing import Any

import jax
import numpy as np


def _zeros(record: Any, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
  del record, rng
  return np.zeros(shape, np.int32)


def fill_integer_fields(record: Any, spec: Any, seed: int = 0) -> Any:
  """`record` (of ShapeDtypeStructs) with its integer fields made concrete.

  Args:
    record: A canonical record of `spec`, its arrays `jax.ShapeDtypeStruct`s.
    spec: The op's `OpSpec`, whose `integer_inputs` fill its integer fields.
    seed: Seed of the random values.

  Returns:
    `record` with numpy arrays in place of its integer `ShapeDtypeStruct`s.
  """
  rng = np.random.default_rng(seed)
  changes = {}
  for field in dataclasses.fields(record):
    value = getattr(record, field.name)
    if field.metadata.get("static") or not isinstance(value, jax.ShapeDtypeStruct):
      continue
    if np.issubdtype(value.dtype, np.integer):
      make = spec.integer_inputs.get(field.name, _zeros)
      changes[field.name] = make(record, tuple(value.shape), rng).astype(value.dtype)
  return dataclasses.replace(record, **changes)
