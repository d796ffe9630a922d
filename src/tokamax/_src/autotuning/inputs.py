"""Concrete inputs for an abstract argument record, for timing candidates.

Float fields stay `jax.ShapeDtypeStruct`s (random normal values come from
`benchmarking.standardize_function`). Integer fields must hold valid values to
be representative, so the canonical integer fields of the library's records
are filled here; any other integer field gets zeros.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from tokamax._src.ops.ragged_dot import spec as ragged_dot_spec


def _group_sizes(record: Any, shape, rng: np.random.Generator) -> np.ndarray:
  if getattr(record, "representative_sizes", None) is not None:
    return np.asarray(record.representative_sizes, np.int32)
  seed = int(rng.integers(1 << 31))
  return ragged_dot_spec.generate_ragged_dot_group_sizes(record.lhs.shape[0], shape[0], seed=seed)


# Canonical field name -> valid values, given the record, the shape and an rng.
_INTEGER_FIELDS: dict[str, Callable[[Any, tuple, np.random.Generator], np.ndarray]] = {
  "group_sizes": _group_sizes,
  "group_offset": lambda record, shape, rng: np.zeros(shape, np.int32),
  "q_seq_lengths": lambda record, shape, rng: np.full(shape, record.query.shape[1], np.int32),
  "kv_seq_lengths": lambda record, shape, rng: np.full(shape, record.key.shape[1], np.int32),
  "labels": lambda record, shape, rng: rng.integers(0, record.weights.shape[1], shape, np.int32),
}


def fill_integer_fields(record: Any, seed: int = 0) -> Any:
  """`record` (of ShapeDtypeStructs) with its integer fields made concrete."""
  rng = np.random.default_rng(seed)
  changes = {}
  for field in dataclasses.fields(record):
    value = getattr(record, field.name)
    if field.metadata.get("static") or not isinstance(value, jax.ShapeDtypeStruct):
      continue
    if np.issubdtype(value.dtype, np.integer):
      make = _INTEGER_FIELDS.get(field.name, lambda record, shape, rng: np.zeros(shape, np.int32))
      changes[field.name] = make(record, tuple(value.shape), rng).astype(value.dtype)
  return dataclasses.replace(record, **changes)
