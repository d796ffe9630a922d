"""Cases: one (op, shape, dtype, feature) each, expanded from a hardware matrix."""

import dataclasses
import functools
import importlib
from typing import Any

import jax

from harness import grads, references
from suites.matrices import ops

NATIVE = "native"  # Implementations compiled for the hardware at hand.
INTERPRET = "interpret"  # Kernels in interpret mode on CPU: small shapes.
LONG = "long"  # Larger shapes for nightly runs.


@dataclasses.dataclass(frozen=True)
class Case:
  """One call of one op.

  Attributes:
    op: The op's name (`SPEC.name`).
    shape: The shape parameters, e.g. (("b", 2), ("t", 64), ...).
    dtype: The input dtype's name.
    feature: The name of a feature variant of the op's builder.
    family: The hardware family whose matrix holds it.
    kind: NATIVE, INTERPRET or LONG.
  """

  op: str
  shape: tuple[tuple[str, Any], ...]
  dtype: str
  feature: str
  family: str
  kind: str = NATIVE

  @property
  def id(self) -> str:
    dims = "_".join(
      f"{k}{'x'.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in self.shape
    )
    return f"{self.feature}-{dims}-{self.dtype}"

  @property
  def shape_dict(self) -> dict[str, Any]:
    return dict(self.shape)

  @property
  def builder(self) -> ops.Builder:
    return ops.BUILDERS[self.op]

  @property
  def features(self) -> dict:
    return self.builder.features[self.feature]

  @property
  def spec(self):
    return ops.spec_of(self.op)

  @property
  def reduction_length(self) -> int:
    return self.builder.reduction_length(self.shape_dict, self.features)

  @property
  def has_matmul(self) -> bool:
    return self.builder.has_matmul

  def build(self, key: jax.Array) -> ops.Built:
    """Random inputs for this case from `key`."""
    return self.builder.build(ops._Draw(key), self.shape_dict, self.dtype, self.features)

  def make_args(self, key: jax.Array) -> tuple[tuple, dict]:
    """(args, kwargs) of the op's public signature, drawn from `key`."""
    built = self.build(key)
    return built.args, built.kwargs

  def reference(self, args: tuple, kwargs: dict):
    """The independent reference at high precision (numpy)."""
    return references.high_precision(self.builder.reference)(grads.widen(args), grads.widen(kwargs))

  def plain(self, args: tuple, kwargs: dict):
    """The reference computed plainly in the input dtype (for the relative rule)."""
    return jax.jit(lambda a: self.builder.reference(a, kwargs))(args)

  def differentiable(self, fn, args: tuple, kwargs: dict) -> tuple:
    """(f, primals): `f(*primals)` is `fn(*args, **kwargs)` with the differentiable args as inputs."""
    diff = self.builder_diff(args)

    def f(*primals):
      full = list(args)
      for i, p in zip(diff, primals, strict=True):
        full[i] = p
      return fn(*full, **kwargs)

    return f, tuple(args[i] for i in diff)

  def builder_diff(self, args: tuple) -> tuple[int, ...]:
    """Positions of the differentiable (floating, present) positional args."""
    floating = lambda a: hasattr(a, "dtype") and jax.numpy.issubdtype(a.dtype, jax.numpy.floating)
    return tuple(
      i
      for i, a in enumerate(args)
      if floating(a) or (isinstance(a, tuple) and a and all(map(floating, a)))
    )

  def call(self, fn, args: tuple, kwargs: dict, *, jit: bool = True):
    """`fn(*args, **kwargs)`, under `jax.jit` (array arguments traced) unless `jit` is False."""
    if not jit:
      return fn(*args, **kwargs)
    is_array = lambda x: hasattr(x, "shape") and hasattr(x, "dtype")
    pos = [
      i
      for i, a in enumerate(args)
      if is_array(a) or (isinstance(a, tuple) and all(map(is_array, a)))
    ]
    kw = [k for k, v in kwargs.items() if is_array(v)]

    def run(pos_values, kw_values):
      full = list(args)
      for i, v in zip(pos, pos_values, strict=True):
        full[i] = v
      return fn(*full, **{**kwargs, **dict(zip(kw, kw_values, strict=True))})

    return jax.jit(run)(tuple(args[i] for i in pos), tuple(kwargs[k] for k in kw))

  def cost(self, args: tuple, kwargs: dict):
    """The op's declared cost (`SPEC.cost`) for this call."""
    spec = self.spec
    return spec.cost(spec.canonicalize(*args, **kwargs))


def _shape_key(shape: dict) -> tuple:
  return tuple(sorted(shape.items(), key=lambda kv: kv[0]))


def _expand(op: str, shapes, dtypes, features, family: str, kind: str) -> list[Case]:
  builder = ops.BUILDERS[op]
  names = list(builder.features) if features in (None, "all") else list(features)
  unknown = set(names) - set(builder.features)
  if unknown:
    raise ValueError(
      f"{family}: unknown features {sorted(unknown)} for {op}; known {list(builder.features)}"
    )
  # A shape may narrow the dtypes it runs with ("dtypes" inside the shape dict).
  return [
    Case(
      op,
      _shape_key({k: v for k, v in shape.items() if k != "dtypes"}),
      dtype,
      feature,
      family,
      kind,
    )
    for shape in shapes
    for dtype in shape.get("dtypes", dtypes)
    for feature in names
  ]


@functools.cache
def matrix_module(family: str):
  """The declarative matrix of a hardware family (`suites.matrices.<family>`)."""
  return importlib.import_module(f"suites.matrices.{family}")


def for_family(family: str, *, op: str | None = None, kind: str = NATIVE) -> list[Case]:
  """The cases of `family`'s matrix, for one op or all, of one kind.

  Args:
    family: "h100", "a100", "tpu_v5" or "cpu".
    op: An op name, or None for every op.
    kind: NATIVE (implementations compiled here), INTERPRET (kernels in
      interpret mode, small shapes), or LONG (nightly shapes).

  Returns:
    The cases, in matrix order.
  """
  matrix = matrix_module(family).MATRIX
  cases = []
  for name, entry in matrix.items():
    if op is not None and name != op:
      continue
    shapes = {
      NATIVE: entry["shapes"],
      INTERPRET: entry.get("interpret_shapes", ()),
      LONG: entry.get("long_shapes", ()),
    }[kind]
    dtypes = entry.get("interpret_dtypes", ("float32",)) if kind == INTERPRET else entry["dtypes"]
    cases += _expand(name, shapes, dtypes, entry.get("features", "all"), family, kind)
  return cases


def gradient_cases(family: str, *, op: str | None = None, kind: str = NATIVE) -> list[Case]:
  """The cases whose gradients are checked: the first shape of each op, every dtype and feature."""
  cases = for_family(family, op=op, kind=kind)
  first = {}
  for case in cases:
    first.setdefault(case.op, case.shape)
  return [c for c in cases if c.shape == first[c.op]]


@dataclasses.dataclass(frozen=True)
class BenchCase:
  """One benchmarked call: a case and the mode ("fwd" or "fwd_bwd")."""

  case: Case
  mode: str

  @property
  def id(self) -> str:
    return f"{self.case.id}-{self.mode}"

  @property
  def op(self) -> str:
    return self.case.op


def bench_cases(family: str, *, op: str | None = None) -> list[BenchCase]:
  """The benchmark cases of `family`'s matrix (`BENCH`)."""
  out = []
  for entry in matrix_module(family).BENCH:
    if op is not None and entry["op"] != op:
      continue
    case = Case(
      entry["op"], _shape_key(entry["shape"]), entry["dtype"], entry["feature"], family, "bench"
    )
    for mode in entry.get("modes", ("fwd", "fwd_bwd")):
      out.append(BenchCase(case, mode))
  return out
