"""The Op model: an op is declared once, implementations register against it.

`OpSpec` declares an op: how its public arguments are validated into one
canonical record, which implementations exist and in which order `None` tries
them. `Op` is the base class of an implementation: a frozen dataclass holding
its config, with hooks for support checks, heuristics, autotuning candidates
and an optional custom backward pass. `dispatch` is the one rule that every op
follows.
"""

import abc
import contextvars
import dataclasses
import functools
import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Self

import jax
import numpy as np

from tokamax._src import arguments as arguments_lib
from tokamax._src import device as device_lib
from tokamax._src.autotuning import autotuner, cache
from tokamax._src.ops import partitioning

# While `tokamax.autotune` traces a function, every op call appends
# (op, abstract args, mode) here, mode "forward" or "vjp" (its custom backward ran).
RECORDED_CALLS: contextvars.ContextVar[list | None] = contextvars.ContextVar(
  "tokamax_recorded_calls", default=None
)


def _record(op: "Op", args: Any, mode: str) -> None:
  calls = RECORDED_CALLS.get()
  if calls is not None:
    calls.append((op, arguments_lib.abstract(args), mode))


@dataclasses.dataclass(frozen=True)
class NoConfig:
  """The config of an implementation that has nothing to tune."""


@dataclasses.dataclass(frozen=True)
class Cost:
  """Work done by one call: floating-point operations and minimum bytes moved."""

  flops: float
  bytes: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Op(abc.ABC):
  """Base class of an implementation of an op.

  Subclasses are frozen dataclasses. They set `name`, `spec` and, when they have
  tunable parameters, `config_cls`; they implement `_fwd` and may implement
  `_bwd` for a custom backward pass.

  Attributes:
    config: A fixed config; `None` takes it from the autotuning cache or the
      heuristics.
  """

  name: ClassVar[str]
  spec: ClassVar["OpSpec"]
  config_cls: ClassVar[type] = NoConfig
  # Platforms on which the implementation compiles natively.
  platforms: ClassVar[tuple[str, ...]] = ("cpu", "gpu", "tpu")
  # Whether JAX can differentiate `_fwd` itself; if not and there is no `_bwd`,
  # the gradient comes from the XLA implementation.
  differentiable: ClassVar[bool] = True
  # Why two runs may give gradients that differ in their last bits, or None.
  nondeterministic_gradients: ClassVar[str | None] = None
  # Whether calls on sharded arrays run on each device's shards by the op's
  # `OpSpec.partitioning` rule; None: the kernels that JAX cannot trace into
  # (`differentiable=False`), which XLA's partitioner cannot split either. The
  # others are split so only on explicit mesh axes, which JAX's sharding in
  # types cannot always type through them.
  partitioned: ClassVar[bool | None] = None
  # Whether autotuning times candidates on the forward alone even where the call
  # is differentiated: true where the VJP runs the forward under a config derived
  # from the chosen one, so timing the pair never times the plain forward that
  # the same entry also serves.
  tuned_on_forward: ClassVar[bool] = False

  config: Any = None

  # -- Hooks for subclasses --------------------------------------------------

  @abc.abstractmethod
  def _fwd(self, args: Any, config: Any) -> tuple[jax.Array, Any]:
    """Returns the output and the residuals that `_bwd` needs (or None)."""

  def _fwd_primal(self, args: Any, config: Any) -> jax.Array:
    """The output alone, when no gradient is taken; may skip saving residuals."""
    return self._fwd(args, config)[0]

  def _bwd(self, args: Any, config: Any, out: jax.Array, residuals: Any, dout: jax.Array) -> dict:
    """Returns the cotangents of the array fields of `args`, by field name."""
    raise NotImplementedError

  def _unsupported_reason(self, args: Any) -> str | None:
    """Why this implementation cannot compute `args`, or None if it can."""
    del args
    return None

  def _bwd_unsupported_reason(self, args: Any) -> str | None:
    """Why `_bwd` cannot compute the gradient for `args`, or None."""
    del args
    if type(self)._bwd is Op._bwd:
      return "no custom backward pass"
    return None

  def _get_heuristics_config(self, args: Any) -> Any:
    """The config used when nothing else chooses one."""
    del args
    return self.config_cls()

  def _get_autotuning_configs(self, args: Any) -> set[Any]:
    """The candidate configs that autotuning tries for `args`."""
    return {self._get_heuristics_config(args)}

  def _forward_config(self, args: Any, config: Any) -> Any:
    """`config` with its `BACKWARD_FIELDS` (fields the forward pass ignores) set as the
    heuristics set them.

    Candidates equal under it run the same forward program, so autotuning a
    forward alone times one of them.
    """
    names = getattr(type(config), "BACKWARD_FIELDS", ())
    if not names:
      return config
    heuristic = self._get_heuristics_config(args)
    return dataclasses.replace(config, **{name: getattr(heuristic, name) for name in names})

  # -- Public interface --------------------------------------------------------

  def bind(self, *args, **kwargs) -> "BoundArguments":
    """Validates the public arguments into the op's canonical record."""
    return BoundArguments(self, self.spec.canonicalize(*args, **kwargs))

  def __call__(self, *args, **kwargs) -> jax.Array:
    """Computes the op, raising `NotImplementedError` if unsupported."""
    record = self.bind(*args, **kwargs).args
    reason = self.unsupported_reason(record)
    if reason is not None:
      raise NotImplementedError(f"{self.spec.name}[{self.name}]: {reason}")
    return self.spec.finalize(record, self.apply(record))

  def supported_on(self, device: jax.Device | None = None) -> bool:
    """Whether this implementation can run on `device` (default backend if None)."""
    platform = device.platform if device is not None else device_lib.platform()
    return self._platform_reason(platform, device) is None

  def _platform_reason(self, platform: str, device: jax.Device | None) -> str | None:
    if platform not in self.platforms:
      return f"runs on {'/'.join(self.platforms)}, not on {platform}"
    return None

  def unsupported_reason(self, args: Any) -> str | None:
    """Why this implementation cannot compute `args` here, or None."""
    return self._platform_reason(device_lib.platform(), None) or self._unsupported_reason(args)

  def resolve_config(self, args: Any) -> Any:
    """The config for `args`: fixed, else tuned, else heuristic."""
    if self.config is not None:
      return self.config
    tuned = cache.lookup(self, args)
    if tuned is not None:
      return tuned
    return self._get_heuristics_config(args)

  def apply(self, args: Any) -> jax.Array:
    """Computes the op for a canonical record, on each device's shards where sharded."""
    partitioned = self.partitioned if self.partitioned is not None else not self.differentiable
    if self.spec.partitioning is None:
      return self._apply_unpartitioned(args)
    return partitioning.apply(self, args, self._apply_unpartitioned, explicit_only=not partitioned)

  def _apply_unpartitioned(self, args: Any) -> jax.Array:
    """Computes the op on whole arrays, choosing the backward pass."""
    _record(self, args, "forward")
    config = self.resolve_config(args)
    if self.differentiable and self._bwd_unsupported_reason(args) is not None:
      return self._fwd_primal(args, config)
    return _with_custom_vjp(self, args, config)

  def with_config(self, config: Any) -> Self:
    return dataclasses.replace(self, config=config)


def _zero_cotangent(x: Any) -> Any:
  if x is None:
    return None
  if jax.dtypes.issubdtype(x.dtype, np.inexact):
    return jax.numpy.zeros(np.shape(x), x.dtype)
  return np.zeros(np.shape(x), jax.dtypes.float0)


def _check_cotangent(label: str, grad: Any, x: Any) -> None:
  """Raises unless an implementation's cotangent of `x` has its shape and dtype (JAX's
  custom_vjp lets a float32 cotangent of a bfloat16 input through)."""
  if grad.dtype == jax.dtypes.float0:
    return
  if np.shape(grad) != np.shape(x) or grad.dtype != x.dtype:
    raise TypeError(
      f"{label}: the backward pass gave a cotangent"
      f" {grad.dtype}{list(np.shape(grad))} for an input {x.dtype}{list(np.shape(x))}."
    )


def field_vmas(arrays: dict) -> tuple[Any, frozenset[str]]:
  """The varying mesh axes of each array field (inside `shard_map`), and their union."""
  vmas = jax.tree.map(partitioning.vma, arrays)
  return vmas, frozenset().union(*jax.tree.leaves(vmas))


def field_cotangents(label: str, grads: dict, arrays: dict) -> tuple[dict]:
  """A custom VJP's cotangents of a record's array fields, from a backward pass's `grads` by
  field name: zeros where it gives none or the field is not inexact, each checked against
  its input, varying (and summed) over the mesh axes as its input (`partitioning.cotangent`)."""
  grads = {
    name: (
      grads[name]
      if grads.get(name) is not None
      and all(jax.dtypes.issubdtype(v.dtype, np.inexact) for v in jax.tree.leaves(value))
      else jax.tree.map(_zero_cotangent, value)
    )
    for name, value in arrays.items()
  }
  jax.tree.map(functools.partial(_check_cotangent, label), grads, arrays)
  vmas, axes = field_vmas(arrays)
  return (jax.tree.map(lambda g, v: partitioning.cotangent(g, v, axes), grads, vmas),)


def _with_custom_vjp(op: Op, args: Any, config: Any) -> jax.Array:
  """Runs `op._fwd` with its own backward pass, or XLA's where it has none."""
  arrays = arguments_lib.array_fields(args)
  rebuild = lambda arrays: dataclasses.replace(args, **arrays)

  # Inside `shard_map`, outputs and cotangents get the varying mesh axes their inputs have.
  _, axes = field_vmas(arrays)

  @jax.custom_vjp
  def run(arrays):
    return partitioning.vary(op._fwd_primal(rebuild(arrays), config), axes)

  def run_fwd(arrays):
    out, residuals = op._fwd(rebuild(arrays), config)
    out, residuals = partitioning.vary((out, residuals), axes)
    return out, (arrays, out, residuals)

  def run_bwd(saved, dout):
    arrays, out, residuals = saved
    record = rebuild(arrays)
    if op._bwd_unsupported_reason(record) is not None:
      # JAX's derivative of the XLA implementation: cotangents typed (and summed over the
      # mesh axes an input does not vary over) by JAX itself.
      reference = op.spec.get("xla")
      _, vjp = jax.vjp(lambda a: reference.apply(rebuild(a)), arrays)
      return vjp(dout)
    _record(op, record, "vjp")
    grads = op._bwd(record, config, out, residuals, dout)
    return field_cotangents(f"{op.spec.name}[{op.name}]", grads, arrays)

  run.defvjp(run_fwd, run_bwd)
  return run(arrays)


@dataclasses.dataclass(frozen=True)
class BoundArguments:
  """An implementation together with canonical arguments."""

  op: Op
  args: Any

  @property
  def arguments(self) -> dict[str, Any]:
    return {f.name: getattr(self.args, f.name) for f in dataclasses.fields(self.args)}

  @property
  def default_config(self) -> Any:
    return self.op.resolve_config(self.args)

  @property
  def heuristics_config(self) -> Any:
    return self.op._get_heuristics_config(self.args)

  @property
  def autotuning_configs(self) -> set[Any]:
    return self.op._get_autotuning_configs(self.args)

  @property
  def key(self) -> str:
    return arguments_lib.signature_key(self.args)

  def autotune(self, **kwargs) -> Any:
    """Times every candidate config and returns the autotuning data."""
    return autotuner.autotune_call(self.op, self.args, **kwargs)


ImplementationLike = str | Op | Callable[..., jax.Array]


@dataclasses.dataclass(frozen=True)
class OpSpec:
  """The declaration of an op.

  Attributes:
    name: The public name, e.g. "layer_norm".
    canonicalize: Validates the public arguments (without `implementation`)
      and returns the canonical record; raises `ValueError`/`TypeError`.
    implementations: Implementation name to "module:Class", imported lazily.
    preference: Platform to the names that `implementation=None` tries, in
      order; "xla" is always tried last.
    reorder: (record, platform, names) -> names: `preference` for one call, where
      measurements found another implementation faster for its features.
    gradient_preference: (record, platform) -> the names that `implementation=None`
      tries under differentiation, where another implementation's forward and
      backward together beat the forward's pick (empty: the forward's pick).
    platform_names: Name to {platform: the implementation it names there};
      e.g. "mosaic" names the Mosaic TPU kernel ("mosaic_tpu") on a TPU.
    cost: Floating-point operations and bytes of one forward call.
    finalize: Maps the implementations' output back to the public layout.
    integer_inputs: Integer field name to a function of (record, shape, numpy
      Generator) giving valid values of that shape, for timing candidates on
      representative inputs; other integer fields are zeros.
    partitioning: The record to its `partitioning.Rule`: how kernel calls split
      across devices on sharded arrays; None gathers them.
  """

  name: str
  canonicalize: Callable[..., Any]
  implementations: Mapping[str, str]
  preference: Mapping[str, tuple[str, ...]]
  cost: Callable[[Any], Cost]
  finalize: Callable[[Any, Any], Any] = lambda args, out: out
  platform_names: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)
  integer_inputs: Mapping[
    str, Callable[[Any, tuple[int, ...], np.random.Generator], np.ndarray]
  ] = dataclasses.field(default_factory=dict)
  partitioning: Callable[[Any], "partitioning.Rule"] | None = None
  reorder: Callable[[Any, str, tuple[str, ...]], tuple[str, ...]] | None = None
  gradient_preference: Callable[[Any, str], tuple[str, ...]] | None = None
  _cache: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

  def __hash__(self) -> int:
    return hash(self.name)

  @property
  def implementation_names(self) -> tuple[str, ...]:
    return tuple(self.implementations)

  def implementation_class(self, name: str) -> type[Op]:
    """The class registered under `name`; `ImportError` if it cannot load."""
    if name not in self.implementations:
      raise ValueError(
        f"{self.name}: unknown implementation {name!r}; valid names are "
        f"{', '.join(map(repr, self.implementations))}."
      )
    module_name, class_name = self.implementations[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)

  def get(self, name: str) -> Op:
    """The implementation `name` with its default config."""
    if name not in self._cache:
      self._cache[name] = self.implementation_class(name)()
    return self._cache[name]

  def default_order(self, platform: str | None = None, record: Any = None) -> tuple[str, ...]:
    """What `implementation=None` tries on `platform` (for `record`, where given)."""
    platform = platform or device_lib.platform()
    names = tuple(n for n in self.preference.get(platform, ()) if n != "xla")
    if record is not None and self.reorder is not None:
      names = self.reorder(record, platform, names)
    return (*names, "xla")

  def resolve(self, implementation: Any, record: Any = None) -> list[Any]:
    """The candidates for `implementation` (for `record`, where given), in the order tried."""
    if implementation is None:
      return list(self.default_order(record=record))
    if isinstance(implementation, str | Op) or callable(implementation):
      implementation = [implementation]
    if isinstance(implementation, Sequence) and implementation:
      return [self.platform_name(c) for c in implementation]
    raise ValueError(
      f"{self.name}: `implementation` must be None, a name, an Op, or a non-empty "
      f"sequence of them; got {implementation!r}."
    )

  def platform_name(self, implementation: Any, platform: str | None = None) -> Any:
    """What a name stands for on `platform` (default: the one lowered for); others as they are."""
    if not isinstance(implementation, str):
      return implementation
    names = self.platform_names.get(implementation, {})
    return names.get(platform or device_lib.platform(), implementation)

  def __call__(self, *args, implementation: Any = None, **kwargs) -> jax.Array:
    """Validates the arguments and runs the first implementation that supports them."""
    for c in self.resolve(implementation):  # Unknown names fail before anything runs.
      if isinstance(c, str):
        self.implementation_class_or_reason(c)
    record = self.canonicalize(*args, **kwargs)
    candidates = self.resolve(implementation, record)
    if implementation is None and self.gradient_preference is not None:
      gradient = self.gradient_preference(record, device_lib.platform())
      if gradient:
        return dispatch_split(self, candidates, gradient, record, args, kwargs)
    return dispatch(self, candidates, record, args, kwargs)

  def implementation_class_or_reason(self, name: str) -> type[Op] | str:
    try:
      return self.implementation_class(name)
    except ImportError as e:
      return f"not available ({e})"


def move_first(name: str, names: tuple[str, ...]) -> tuple[str, ...]:
  """`names` with `name` first, where it is one of them (for `OpSpec.reorder` rules)."""
  return (name, *(n for n in names if n != name)) if name in names else names


def _supporting(spec: OpSpec, candidate: str | Op, record: Any) -> Op | str:
  """The implementation `candidate` (a name or an Op) if it supports `record`, else why not."""
  if isinstance(candidate, str):
    cls = spec.implementation_class_or_reason(candidate)
    if isinstance(cls, str):
      return f"{candidate}: {cls}"
    candidate = spec.get(candidate)
  reason = candidate.unsupported_reason(record)
  return candidate if reason is None else f"{candidate.name}: {reason}"


def _first_supported(spec: OpSpec, names: Sequence[str], record: Any) -> Op | None:
  picks = (_supporting(spec, name, record) for name in names)
  return next((pick for pick in picks if isinstance(pick, Op)), None)


def dispatch_split(
  spec: OpSpec,
  candidates: list[Any],
  gradient: Sequence[str],
  record: Any,
  args: tuple,
  kwargs: dict,
) -> Any:
  """Like `dispatch`, but under differentiation the first of `gradient` that supports
  `record` computes the forward and backward; the value alone stays the forward's pick's."""
  forward = _first_supported(spec, candidates, record)
  differentiated = _first_supported(spec, gradient, record)
  if forward is None or differentiated is None or forward is differentiated:
    return dispatch(spec, candidates, record, args, kwargs)
  arrays = arguments_lib.array_fields(record)
  rebuild = lambda arrays: dataclasses.replace(record, **arrays)

  @jax.custom_vjp
  def run(arrays):
    return forward.apply(rebuild(arrays))

  def run_fwd(arrays):
    # The whole VJP (a pytree of residuals) of the implementation that differentiates.
    return jax.vjp(lambda a: differentiated.apply(rebuild(a)), arrays)

  def run_bwd(vjp, dout):
    return vjp(dout)

  run.defvjp(run_fwd, run_bwd)
  return spec.finalize(record, run(arrays))


def dispatch(spec: OpSpec, candidates: list[Any], record: Any, args: tuple, kwargs: dict) -> Any:
  """Runs the first candidate that supports `record`; else one error with every reason."""
  reasons = []
  for candidate in candidates:
    if isinstance(candidate, str | Op):
      pick = _supporting(spec, candidate, record)
      if isinstance(pick, Op):
        return spec.finalize(record, pick.apply(record))
      reasons.append(pick)
      continue
    try:
      return candidate(*args, **kwargs)
    except NotImplementedError as e:
      reasons.append(f"{getattr(candidate, '__name__', candidate)!r}: {e}")
  raise NotImplementedError(
    f"{spec.name}: no implementation supports this call:\n  " + "\n  ".join(reasons)
  )
