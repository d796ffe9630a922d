"""Canonical argument records shared by every implementation of an op.

Each op declares one frozen dataclass of its canonical arguments. Array fields
are pytree children; every other field is static metadata, so the record can
cross `jax.jit`, `jax.custom_vjp` and `jax.vmap` boundaries as one value.
"""

import dataclasses
import functools
from typing import Any

import jax
import numpy as np


def static(default: Any = dataclasses.MISSING) -> Any:
  """Marks a dataclass field as static (not traced)."""
  if default is dataclasses.MISSING:
    return dataclasses.field(metadata={"static": True})
  return dataclasses.field(default=default, metadata={"static": True})


def op_arguments[T](cls: type[T]) -> type[T]:
  """Makes `cls` a frozen dataclass registered as a pytree."""
  cls = dataclasses.dataclass(frozen=True)(cls)
  fields = dataclasses.fields(cls)
  data = [f.name for f in fields if not f.metadata.get("static")]
  meta = [f.name for f in fields if f.metadata.get("static")]
  return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)


def array_fields(args: Any) -> dict[str, Any]:
  """The traced fields of an argument record."""
  return {
    f.name: getattr(args, f.name) for f in dataclasses.fields(args) if not f.metadata.get("static")
  }


def abstract(args: Any) -> Any:
  """The record with every array replaced by its shape and dtype."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), args)


def signature_key(args: Any) -> str:
  """A stable string that identifies the shapes, dtypes and static values."""
  parts = []
  for f in dataclasses.fields(args):
    value = getattr(args, f.name)
    if f.metadata.get("static"):
      parts.append(f"{f.name}={_stable_repr(value)}")
    else:
      leaves = jax.tree.leaves(value)
      desc = ",".join(f"{np.dtype(x.dtype).name}{list(np.shape(x))}" for x in leaves)
      parts.append(f"{f.name}=({desc})" if leaves else f"{f.name}=None")
  return f"{type(args).__name__}(" + ", ".join(parts) + ")"


def _stable_repr(value: Any) -> str:
  """`repr`, with functions named by module and qualified name (their reprs hold addresses)."""
  if isinstance(value, functools.partial):
    args = [_stable_repr(a) for a in value.args]
    args += [f"{k}={_stable_repr(v)}" for k, v in sorted(value.keywords.items())]
    return f"partial({', '.join([_stable_repr(value.func), *args])})"
  if callable(value) and not isinstance(value, type) and hasattr(value, "__qualname__"):
    return f"{getattr(value, '__module__', None) or '?'}.{value.__qualname__}"
  return repr(value)
