"""Cases: one (op, shape, dtype, feature) each, expanded from a hardware matrix."""

import dataclasses
from typing import Any

import jax

from suites import opdb
from tokamax_harness import grads, references

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
    feature: The name of a feature variant of the op's entry.
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
  def info(self) -> opdb.OpInfo:
    """The op's entry in the op database."""
    return opdb.get(self.op)

  @property
  def features(self) -> dict:
    if self.feature in self.info.features:
      return self.info.features[self.feature]
    return self.info.bench_features[self.feature]

  @property
  def spec(self):
    return self.info.spec

  @property
  def reduction_length(self) -> int:
    return self.info.reduction_length(self.shape_dict, self.features)

  @property
  def has_matmul(self) -> bool:
    return self.info.has_matmul

  def build(self, key: jax.Array) -> opdb.Built:
    """Random inputs for this case from `key`."""
    return self.info.build(opdb.Draw(key), self.shape_dict, self.dtype, self.features)

  def make_args(self, key: jax.Array) -> tuple[tuple, dict]:
    """(args, kwargs) of the op's public signature, drawn from `key`."""
    built = self.build(key)
    return built.args, built.kwargs

  def reference(self, args: tuple, kwargs: dict):
    """The independent reference at high precision (numpy)."""
    return references.high_precision(self.info.reference)(grads.widen(args), grads.widen(kwargs))

  def plain(self, args: tuple, kwargs: dict):
    """The reference computed plainly in the input dtype (for the relative rule)."""
    return jax.jit(lambda a: self.info.reference(a, kwargs))(args)

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

  def at_golden_shape(self) -> "Case":
    """This case at its op's small golden shape."""
    return dataclasses.replace(self, shape=shape_key(self.info.golden_shape))


def shape_key(shape: dict) -> tuple:
  return tuple(sorted(shape.items(), key=lambda kv: kv[0]))


def _expand(op: str, shapes, dtypes, family: str, kind: str) -> list[Case]:
  names = list(opdb.get(op).features)
  # A shape may narrow the dtypes it runs with ("dtypes" inside the shape dict).
  return [
    Case(
      op,
      shape_key({k: v for k, v in shape.items() if k != "dtypes"}),
      dtype,
      feature,
      family,
      kind,
    )
    for shape in shapes
    for dtype in shape.get("dtypes", dtypes)
    for feature in names
  ]


def for_family(family: str, *, op: str | None = None, kind: str = NATIVE) -> list[Case]:
  """The cases of `family`'s matrix, for one op or all, of one kind.

  Args:
    family: "h100", "a100", "tpu_v5" or "cpu".
    op: An op name, or None for every op.
    kind: NATIVE (implementations compiled here), INTERPRET (kernels in
      interpret mode, small shapes), or LONG (nightly shapes).

  Returns:
    The cases, in op-database order.
  """
  cases = []
  for name in [op] if op is not None else opdb.OPS:
    matrix = opdb.get(name).matrices.get(family)
    if matrix is None:
      continue
    shapes = {
      NATIVE: matrix.shapes,
      INTERPRET: matrix.interpret_shapes,
      LONG: matrix.long_shapes,
    }[kind]
    dtypes = matrix.interpret_dtypes if kind == INTERPRET else matrix.dtypes
    cases += _expand(name, shapes, dtypes, family, kind)
  return cases


def gradient_cases(family: str, *, op: str | None = None, kind: str = NATIVE) -> list[Case]:
  """The cases whose gradients are checked: per op and dtype its first shape, every feature."""
  cases = for_family(family, op=op, kind=kind)
  first = {}
  for case in cases:
    first.setdefault((case.op, case.dtype), case.shape)
  return [c for c in cases if c.shape == first[c.op, c.dtype]]


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
  """The benchmark cases of `family` (each op's `bench` calls)."""
  out = []
  for name in [op] if op is not None else opdb.OPS:
    for call in opdb.get(name).bench.get(family, ()):
      case = Case(name, shape_key(call.shape), call.dtype, call.feature, family, "bench")
      out += [BenchCase(case, mode) for mode in call.modes]
  return out
