"""Kernel calls on sharded arrays: one partitioning mechanism, a rule declared per op.

A kernel is an opaque custom call to XLA's partitioner, which gathers its operands
to every device. Instead an op declares, in `OpSpec.partitioning`, a `Rule` naming
every axis of its arrays and of its output (axes with the same label are one
dimension) and which labels may be split across devices; `apply` then runs the
implementation on each device's shards:

- on arrays whose shardings are known when traced (sharded arrays passed eagerly,
  or explicit mesh axes), through `jax.shard_map`;
- otherwise under `jax.jit`, through `jax.experimental.custom_partitioning`: XLA's
  partitioner hands the operand shardings to the same planner.

Where a split label is missing from the output (the rows of a reduced loss, the groups
of expert parallelism, a loss's vocabulary), the rule declares per label how the
shards' outputs combine, summed or averaged; an implementation may first combine values
across the shards itself (the loss's log-sum-exp over vocabulary shards).

The XLA implementations, which XLA's partitioner splits itself, take the same route on
explicit mesh axes only: JAX's sharding in types cannot type all of them (scans,
contractions over sharded rows, the loss's label gather, ragged_dot).

An axis sharded over devices that its label does not allow to split is replicated
(gathered), with a one-time warning naming it. The gradient is partitioned the same
way: through `shard_map`, JAX differentiates the split call (the implementation's own
backward pass on each shard; `vary` and `cotangent` type a kernel's outputs and sum
the cotangents of arrays without a split label); through `custom_partitioning`, which
JAX cannot differentiate, the backward pass is a second partitioned call that
recomputes the shard's forward pass.
"""

import contextlib
import contextvars
import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import custom_partitioning as cp_lib
from jax.sharding import NamedSharding, PartitionSpec

from tokamax._src import arguments, triton_call

# A label per axis: a name, a tuple of names for an axis that is their product (the
# first the major one; only it can be split), or None for an axis that never splits.
Label = str | tuple[str, ...] | None
Labels = tuple[Label, ...]


@dataclasses.dataclass(frozen=True)
class Shard:
  """The devices one split label is divided over, seen from inside a shard."""

  axes: tuple[str, ...]
  count: int

  def index(self) -> jax.Array:
    """This device's position along the split (0 .. count - 1)."""
    return jax.lax.axis_index(self.axes)


@dataclasses.dataclass(frozen=True)
class Rule:
  """How calls of an op split across devices.

  Attributes:
    inputs: Array field name to the labels of its axes; a list of them, one per
      leaf, for a field holding several arrays (e.g. a tuple of weights). A field
      not named has no axis that splits.
    output: The labels of the output's axes.
    split: The labels that may be split across devices.
    combine: How the shards of a split label missing from the output combine
      their outputs: "sum" or "mean" (e.g. a loss reduced over rows); one for
      every such label, or a mapping from label to it. Not read for labels in
      the output.
    localize: Maps the record of one shard to what the implementation computes
      there (e.g. global group sizes to the shard's), given the `Shard` of each
      split label.
  """

  inputs: Mapping[str, Labels | list[Labels]]
  output: Labels
  split: frozenset[str]
  combine: str | Mapping[str, str] | None = None
  localize: Callable[[Any, Mapping[str, Shard]], Any] | None = None

  def combine_of(self, label: str) -> str | None:
    """How the shards of `label` combine outputs that lack it."""
    if isinstance(self.combine, Mapping):
      return self.combine.get(label)
    return self.combine

  def leaf_labels(self, args: Any) -> list[tuple[str, Labels]]:
    """(field, labels) for every array leaf of `args`, in `jax.tree.leaves` order."""
    out = []
    for name, value in arguments.array_fields(args).items():
      leaves = jax.tree.leaves(value)
      labels = self.inputs.get(name)
      if not leaves:
        continue
      if labels is None:
        labels = [(None,) * np.ndim(x) for x in leaves]
      elif not isinstance(labels, list):
        labels = [labels]
      if len(labels) != len(leaves):
        raise ValueError(f"rule names {len(labels)} arrays for field {name!r}, not {len(leaves)}")
      for x, lab in zip(leaves, labels, strict=True):
        if len(lab) != np.ndim(x):
          raise ValueError(f"rule labels {lab} for {name!r} of rank {np.ndim(x)}")
        out.append((name, tuple(lab)))
    return out


def _major(label: Label) -> str | None:
  return label[0] if isinstance(label, tuple) else label


_warned: set[tuple] = set()


def _warn_once(op_name: str, field: str, axis: int, label: Label, mesh_axes: tuple[str, ...]):
  key = (op_name, field, axis, label, mesh_axes)
  if key in _warned:
    return
  _warned.add(key)
  warnings.warn(
    f"{op_name}: axis {axis} ({label or 'unnamed'}) of `{field}` is sharded over mesh "
    f"axes {mesh_axes}, which this op cannot split; it is replicated on every device.",
    stacklevel=4,
  )


def _spec_axes(spec: PartitionSpec, ndim: int) -> list[tuple[str, ...]]:
  entries = (*spec, *(None,) * (ndim - len(spec)))
  return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries]


@dataclasses.dataclass(frozen=True)
class Plan:
  """Which mesh axes every split label gets, and what follows for each array."""

  shards: Mapping[str, Shard]
  in_specs: tuple[PartitionSpec, ...]
  out_spec: PartitionSpec
  grad_sums: tuple[tuple[str, ...], ...]  # Per leaf: mesh axes its cotangent sums over.
  out_sums: tuple[str, ...]  # Mesh axes the output is summed over.
  out_means: tuple[str, ...] = ()  # Mesh axes the output is averaged over.

  @property
  def splits(self) -> bool:
    return bool(self.shards)

  @property
  def mean_count(self) -> int:
    """The shards that the output is averaged over."""
    return math.prod(s.count for s in self.shards.values() if set(s.axes) <= set(self.out_means))


def _factor_sizes(leaf_labels, shapes) -> dict[str, int]:
  sizes = {}
  for (_, labels), shape in zip(leaf_labels, shapes, strict=True):
    for label, n in zip(labels, shape, strict=True):
      if isinstance(label, str):
        sizes.setdefault(label, n)
  for (_, labels), shape in zip(leaf_labels, shapes, strict=True):
    for label, n in zip(labels, shape, strict=True):
      if isinstance(label, tuple):
        known = math.prod(sizes.get(f, 1) for f in label)
        for f in label:
          sizes.setdefault(f, n // known)
  return sizes


def plan(
  op_name: str,
  rule: Rule,
  leaf_labels: list[tuple[str, Labels]],
  shapes: Sequence[tuple[int, ...]],
  specs: Sequence[PartitionSpec],
  mesh_shape: Mapping[str, int],
) -> Plan:
  """Splits every label that an operand is sharded along and the rule allows; warns on others."""
  sizes = _factor_sizes(leaf_labels, shapes)
  factors: dict[str, tuple[str, ...]] = {}
  used: set[str] = set()
  for (field, labels), shape, spec in zip(leaf_labels, shapes, specs, strict=True):
    for axis, (label, mesh_axes) in enumerate(
      zip(labels, _spec_axes(spec, len(shape)), strict=True)
    ):
      factor = _major(label)
      if not mesh_axes or (factor in factors and factors[factor] == mesh_axes):
        continue
      count = math.prod(mesh_shape[a] for a in mesh_axes)
      if (
        factor in rule.split
        and factor not in factors
        and sizes[factor] % count == 0
        and not used.intersection(mesh_axes)
      ):
        factors[factor] = mesh_axes
        used.update(mesh_axes)
      elif factor not in factors:
        _warn_once(op_name, field, axis, label, mesh_axes)

  def spec_of(labels: Labels) -> PartitionSpec:
    return PartitionSpec(*(factors.get(_major(label)) for label in labels))

  def sums(labels: Labels, how: str | None = None) -> tuple[str, ...]:
    present = {_major(label) for label in labels}
    return tuple(
      a
      for f, axes in factors.items()
      if f not in present and how in (None, rule.combine_of(f))
      for a in axes
    )

  missing = [f for f in factors if f not in {_major(label) for label in rule.output}]
  for f in missing:
    if (how := rule.combine_of(f)) not in ("sum", "mean"):
      raise ValueError(
        f"{op_name}: the output lacks split label {f!r}, whose `combine` must be 'sum' or"
        f" 'mean', got {how!r}"
      )
  return Plan(
    shards={f: Shard(axes, math.prod(mesh_shape[a] for a in axes)) for f, axes in factors.items()},
    in_specs=tuple(spec_of(labels) for _, labels in leaf_labels),
    out_spec=spec_of(rule.output),
    grad_sums=tuple(sums(labels) for _, labels in leaf_labels),
    out_sums=sums(rule.output, "sum"),
    out_means=sums(rule.output, "mean"),
  )


def vma(x: Any) -> frozenset[str]:
  """The manual mesh axes `x` varies over (inside `shard_map`)."""
  manual = getattr(jax.typeof(x), "manual_axis_type", None)
  return frozenset(getattr(manual, "varying", ()))


def record_vma(args: Any) -> frozenset[str]:
  """The manual mesh axes that any array of the record `args` varies over."""
  return frozenset().union(*map(vma, jax.tree.leaves(arguments.array_fields(args))))


def kernel_output(shape: tuple[int, ...], dtype: Any, *inputs: jax.Array) -> jax.ShapeDtypeStruct:
  """A kernel's output type (`pallas_call(out_shape=...)`): inside `shard_map`, varying
  over the mesh axes that its inputs vary over.

  Every Mosaic TPU `pallas_call` types its outputs here: under `shard_map` (which checks
  them) a plain `ShapeDtypeStruct` fails. Mosaic GPU's `plgpu.kernel` skips that check
  and Triton's calls are untyped; `vary` types their outputs.
  """
  axes = frozenset().union(*map(vma, inputs))
  return jax.ShapeDtypeStruct(
    shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=axes)
  )


def vary(out: Any, axes: frozenset[str]) -> Any:
  """`out` varying over `axes`: a kernel's custom call or host callback leaves them untyped."""

  def one(x):
    missing = tuple(sorted(axes - vma(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(one, out) if axes else out


def cotangent(grad: jax.Array, x_axes: frozenset[str], axes: frozenset[str]) -> jax.Array:
  """A kernel's cotangent of an input varying over `x_axes`, of inputs varying over `axes`.

  The cotangent varies over `axes`; it is summed over those the input does not vary over.
  """
  if grad.dtype == jax.dtypes.float0:
    return grad
  grad = vary(grad, axes)
  extra = tuple(sorted(vma(grad) - x_axes))
  return jax.lax.psum(grad, extra) if extra else grad


# Set while an implementation runs on one shard: ops it calls run there as they are.
_LOCAL: contextvars.ContextVar[bool] = contextvars.ContextVar("tokamax_local", default=False)


@contextlib.contextmanager
def _local():
  token = _LOCAL.set(True)
  try:
    yield
  finally:
    _LOCAL.reset(token)


@dataclasses.dataclass(frozen=True)
class _Call:
  """One op call: its record, the rule, and the unpartitioned computation."""

  op_name: str
  rule: Rule
  args: Any
  run: Callable[[Any], jax.Array]

  def record(self, leaves, plan_: Plan | None) -> Any:
    args = jax.tree.unflatten(jax.tree.structure(self.args), leaves)
    if plan_ is not None and self.rule.localize is not None and plan_.splits:
      args = self.rule.localize(args, plan_.shards)
    return args

  def forward(self, plan_: Plan | None) -> Callable[..., jax.Array]:
    """The computation on one shard of every operand."""

    def local(*leaves):
      with _local():
        out = self.run(self.record(leaves, plan_))
      if plan_ is not None and plan_.out_sums:
        out = jax.lax.psum(out, plan_.out_sums)
      if plan_ is not None and plan_.out_means:
        out = jax.lax.pmean(out, plan_.out_means)
      return out

    return local

  def inexact(self) -> list[int]:
    leaves = jax.tree.leaves(self.args)
    return [i for i, x in enumerate(leaves) if jax.dtypes.issubdtype(x.dtype, np.inexact)]

  def backward(self, plan_: Plan | None) -> Callable[..., tuple[jax.Array, ...]]:
    """The cotangents of the inexact operands on one shard, from the output's."""
    index = self.inexact()

    def local(*leaves_and_dout):
      *leaves, dout = leaves_and_dout
      if plan_ is not None and plan_.out_means:
        dout = dout / plan_.mean_count

      def fn(floats):
        full = list(leaves)
        for i, x in zip(index, floats, strict=True):
          full[i] = x
        with _local():
          return self.run(self.record(full, plan_))

      _, vjp = jax.vjp(fn, [leaves[i] for i in index])
      (grads,) = vjp(dout)
      if plan_ is not None:
        grads = [
          jax.lax.psum(g, plan_.grad_sums[i]) if plan_.grad_sums[i] else g
          for i, g in zip(index, grads, strict=True)
        ]
      return tuple(grads)

    return local


def _with_vjp(call: _Call, partition: Callable[[Callable, bool], Callable]) -> jax.Array:
  """The call with a gradient that `partition` splits like the forward pass.

  `partition(make, backward)` wraps `make(plan)` (the computation on one shard) so that
  it runs on every shard; `backward` says whether it takes the output's cotangent too.
  """
  leaves = jax.tree.leaves(call.args)
  index = call.inexact()

  @jax.custom_vjp
  def run(*leaves):
    return partition(call.forward, False)(*leaves)

  def run_fwd(*leaves):
    return run(*leaves), leaves

  def run_bwd(leaves, dout):
    grads = iter(partition(call.backward, True)(*leaves, dout))
    return tuple(
      next(grads) if i in index else np.zeros(np.shape(x), jax.dtypes.float0)
      for i, x in enumerate(leaves)
    )

  run.defvjp(run_fwd, run_bwd)
  return run(*leaves)


def _shard_map(call: _Call, mesh, plan_: Plan) -> jax.Array:
  """The call split by `plan_` over `mesh`; JAX differentiates through `shard_map`.

  The implementation's own backward pass runs on each shard, on its residuals; the
  cotangents of operands lacking a split label are summed by its custom VJP
  (`op._with_custom_vjp`), from the varying mesh axes that `shard_map` tracks.
  """
  fn = jax.shard_map(
    call.forward(plan_), mesh=mesh, in_specs=plan_.in_specs, out_specs=plan_.out_spec
  )
  leaves = jax.tree.leaves(call.args)
  return fn(*map(functools.partial(_resharded, mesh), leaves, plan_.in_specs))


def _resharded(mesh, x: jax.Array, spec: PartitionSpec) -> jax.Array:
  """`x` sharded by `spec`: an axis the op cannot split is gathered here, as warned."""
  ndim = np.ndim(x)
  if isinstance(x, jax.core.Tracer):
    current = jax.typeof(x).sharding.spec
    return (
      x if _spec_axes(current, ndim) == _spec_axes(spec, ndim) else jax.sharding.reshard(x, spec)
    )
  if isinstance(mesh, jax.sharding.AbstractMesh):
    # Traced outside jit (jax.grad, jax.vmap): a constant the call closes over cannot be
    # put on the tracers' abstract mesh, only resharded onto it.
    return jax.sharding.reshard(x, NamedSharding(mesh, spec))
  sharding = getattr(x, "sharding", None)
  if (
    isinstance(sharding, NamedSharding)
    and sharding.mesh == mesh
    and _spec_axes(sharding.spec, ndim) == _spec_axes(spec, ndim)
  ):
    return x
  return jax.device_put(x, NamedSharding(mesh, spec))


def _sdy_rule(leaf_labels, shapes, out_labels: list[Labels]) -> cp_lib.SdyShardingRule:
  sizes = _factor_sizes(leaf_labels, shapes)
  simple = set()
  counter = iter(range(1 << 30))

  def mapping(labels: Labels) -> cp_lib.ArrayMapping:
    dims = []
    for label in labels:
      if label is None:
        dims.append(f"unsplit{next(counter)}")
      elif isinstance(label, tuple):
        # Shardy takes no size-1 factor in a compound one.
        factors = [f for f in label if sizes[f] != 1] or [label[0]]
        dims.append(cp_lib.CompoundFactor(*factors) if len(factors) > 1 else factors[0])
        simple.update(factors if len(factors) == 1 else ())
      else:
        dims.append(label)
        simple.add(label)
    return cp_lib.ArrayMapping(*dims)

  operands = tuple(mapping(labels) for _, labels in leaf_labels)
  results = tuple(mapping(labels) for labels in out_labels)
  compound = {
    f for _, labels in leaf_labels for lab in labels if isinstance(lab, tuple) for f in lab
  }
  used = {f for m in operands + results for d in m for f in ((d,) if isinstance(d, str) else d)}
  return cp_lib.SdyShardingRule(
    operands, results, **{f: sizes[f] for f in (compound & used) - simple}
  )


def _custom_partitioning(call: _Call) -> jax.Array:
  leaf_labels = call.rule.leaf_labels(call.args)
  leaves = jax.tree.leaves(call.args)
  shapes = [np.shape(x) for x in leaves]
  index = call.inexact()

  def partition(make, backward):
    labels = leaf_labels + ([("out", call.rule.output)] if backward else [])
    out_labels = [leaf_labels[i][1] for i in index] if backward else [call.rule.output]
    all_shapes = shapes + ([_out_shape(call)] if backward else [])

    def partition_fn(mesh, arg_shapes, result_shape):
      del result_shape
      specs = [s.sharding.spec for s in arg_shapes[: len(leaves)]]
      plan_ = plan(call.op_name, call.rule, leaf_labels, shapes, specs, mesh.shape)
      in_specs = plan_.in_specs + ((plan_.out_spec,) if backward else ())
      out = (
        tuple(NamedSharding(mesh, plan_.in_specs[i]) for i in index)
        if backward
        else NamedSharding(mesh, plan_.out_spec)
      )
      return mesh, make(plan_), out, tuple(NamedSharding(mesh, s) for s in in_specs)

    fn = cp_lib.custom_partitioning(make(None))
    fn.def_partition(
      partition_fn, sharding_rule=_sdy_rule(labels, all_shapes, out_labels), decode_shardings=True
    )
    # custom_partitioning has no batching rule: under vmap, each shard runs the batch.
    batched = jax.custom_batching.custom_vmap(fn)

    @batched.def_vmap
    def _(axis_size, in_batched, *args):
      del axis_size
      in_axes = [0 if b else None for b in in_batched]
      out = jax.vmap(make(None), in_axes=in_axes)(*args)
      return out, jax.tree.map(lambda _: True, out)

    return batched

  return _with_vjp(call, partition)


def _out_shape(call: _Call) -> tuple[int, ...]:
  return jax.eval_shape(call.run, arguments.abstract(call.args)).shape


def _inspect(leaves) -> tuple[str, Any, list[PartitionSpec] | None]:
  """How the operands are sharded, as far as tracing tells.

  Returns:
    ("known", mesh, specs): every mesh axis is explicit (or the arrays are concrete);
    ("auto", None, None): some axes are automatic, the shardings come at compile time;
    ("local", None, None): inside `shard_map` over every axis; ("none", None, None).
  """
  mesh, specs, auto = None, [], False
  for x in leaves:
    if isinstance(x, jax.core.Tracer):
      sharding = jax.typeof(x).sharding
    else:
      sharding = getattr(x, "sharding", None)
      if not isinstance(sharding, NamedSharding):
        specs.append(PartitionSpec())
        continue
    m = sharding.mesh
    if m.empty or m.size == 1:
      specs.append(PartitionSpec())
      continue
    types = set(getattr(m, "axis_types", ()))
    if types == {jax.sharding.AxisType.Manual}:
      return "local", None, None
    auto = auto or (isinstance(x, jax.core.Tracer) and jax.sharding.AxisType.Explicit not in types)
    mesh = m if mesh is None else mesh
    specs.append(sharding.spec if m == mesh else PartitionSpec())
  if auto:
    return "auto", None, None
  return ("none", None, None) if mesh is None else ("known", mesh, specs)


def apply(
  op: Any, args: Any, run: Callable[[Any], jax.Array], *, explicit_only: bool = False
) -> jax.Array:
  """`run(args)` on each device's shards of `args`, by `op.spec.partitioning`.

  With `explicit_only`, only where the operands' mesh has explicit axes (an
  implementation that XLA partitions itself, but that JAX's sharding in types cannot
  type: contractions over sharded rows, gathers, scans, ragged_dot); else `run(args)`.
  """
  rule_fn = op.spec.partitioning
  if rule_fn is None or _LOCAL.get() or jax.device_count() == 1:
    return run(args)
  leaves = jax.tree.leaves(args)
  kind, mesh, specs = _inspect(leaves)
  if kind in ("local", "none"):
    return run(args)
  if explicit_only and not (kind == "known" and _has_explicit_axes(mesh)):
    return run(args)
  rule = rule_fn(args)
  call = _Call(f"{op.spec.name}[{op.name}]", rule, args, run)
  if kind == "known":
    shapes = [np.shape(x) for x in leaves]
    plan_ = plan(call.op_name, rule, rule.leaf_labels(args), shapes, specs, dict(mesh.shape))
    return _shard_map(call, mesh, plan_) if plan_.splits else run(args)
  if _uses_host_callbacks(op):
    # An interpreter's host callbacks cannot run inside XLA's partitioner: the call
    # is gathered (with explicit mesh axes it is split, above).
    return run(args)
  return _custom_partitioning(call)


def _has_explicit_axes(mesh: Any) -> bool:
  return jax.sharding.AxisType.Explicit in set(getattr(mesh, "axis_types", ()))


def _uses_host_callbacks(op: Any) -> bool:
  return bool(getattr(op, "interpret", False)) or triton_call.interpreting()
