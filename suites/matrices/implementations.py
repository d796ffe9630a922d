"""Implementations of an op as the hardware at hand can run them.

Every name in `SPEC.implementations` is considered. One that fails to import,
or whose platform check fails here, is reported with its reason (the suites
skip it with that reason). On CPU, kernels run in interpret mode where they
offer one: an `interpret` field on the implementation's dataclass (Pallas), or
Triton's host interpreter (`triton_call.interpret()`), called eagerly.
"""

import contextlib
import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any

from tokamax._src.ops import op as op_lib
from tokamax_harness import hardware


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One implementation of one op, ready to call here (or why not).

  Attributes:
    op: The op's name (`SPEC.name`).
    name: The implementation's name in `SPEC.implementations`.
    family: Its implementation family (see `tokamax_harness.hardware`).
    instance: The `Op` to call, or None if it cannot run here.
    reason: Why it cannot run here, or None.
    interpret: Whether it runs in interpret mode (CPU; small shapes only).
    eager: Whether it must be called outside `jax.jit` (Triton's interpreter).
    error: The error its module raised on import other than `ImportError`
      (a broken module: its tests fail with it rather than skip).
    variant: The label of a fixed config from the op database's
      `config_variants`, or None for the default config.
  """

  op: str
  name: str
  family: str
  instance: op_lib.Op | None
  reason: str | None
  interpret: bool = False
  eager: bool = False
  error: str | None = None
  variant: str | None = None

  @property
  def label(self) -> str:
    """The name in test ids: `name`, or `name@variant` for a fixed config."""
    return self.name if self.variant is None else f"{self.name}@{self.variant}"

  @property
  def spec(self) -> op_lib.OpSpec:
    return self.instance.spec

  def context(self):
    """The context to call it in (Triton's interpreter where that applies)."""
    if self.interpret and self.family == hardware.TRITON:
      from tokamax._src import triton_call

      return triton_call.interpret()
    return contextlib.nullcontext()

  def unsupported_reason(self, args: tuple, kwargs: dict) -> str | None:
    """Why it cannot compute this call, or None; raises if its module is broken."""
    if self.error is not None:
      raise AssertionError(f"{self.op}[{self.name}] failed to import: {self.error}")
    if self.instance is None:
      return self.reason
    record = self.spec.canonicalize(*args, **kwargs)
    with self.context():  # In an interpreter the implementation judges the call as it runs it.
      return self.instance.unsupported_reason(record)

  def __call__(self, *args, **kwargs) -> Any:
    """Computes the op through this implementation (canonicalize, apply, finalize)."""
    spec = self.spec
    record = spec.canonicalize(*args, **kwargs)
    with self.context():
      return spec.finalize(record, self.instance.apply(record))


def _family(spec: op_lib.OpSpec, name: str, cls: type | None) -> str:
  module = spec.implementations[name].split(":")[0]
  if cls is not None:
    mod = importlib.import_module(module)
    if hasattr(mod, "triton_call") or "triton" in module.rsplit(".", 1)[-1]:
      return hardware.TRITON
  return hardware.implementation_family(spec.implementations[name])


def resolve(
  spec: op_lib.OpSpec, name: str, profile: hardware.Profile | None = None
) -> Implementation:
  """Implementation `name` of `spec` as it can run on `profile` (default: here)."""
  profile = profile or hardware.detect()
  try:
    cls = spec.implementation_class_or_reason(name)
  except Exception as e:  # A module that exists but is broken.
    error = f"{type(e).__name__}: {e}"
    return Implementation(spec.name, name, _family(spec, name, None), None, None, error=error)
  if isinstance(cls, str):
    return Implementation(spec.name, name, _family(spec, name, None), None, cls)
  family = _family(spec, name, cls)
  fields = {f.name for f in dataclasses.fields(cls)}
  if profile.platform == "cpu" and family != hardware.XLA and family != hardware.CUDNN:
    if "interpret" in fields:
      return Implementation(spec.name, name, family, cls(interpret=True), None, interpret=True)
    if family == hardware.TRITON:
      return Implementation(spec.name, name, family, cls(), None, interpret=True, eager=True)
  instance = cls()
  reason = instance._platform_reason(profile.platform, None)
  if reason is None and family in (hardware.MOSAIC_GPU, hardware.TRITON, hardware.CUDNN):
    reason = profile.reason_cannot_run(family)
  if reason is not None:
    return Implementation(spec.name, name, family, None, reason)
  return Implementation(spec.name, name, family, instance, None)


def with_variant(impl: Implementation, label: str, fields: dict) -> Implementation:
  """`impl` with the fixed config `fields` (of its config class), labelled `label`."""
  if impl.instance is None:
    return dataclasses.replace(impl, variant=label)
  config = impl.instance.config_cls(**fields)
  return dataclasses.replace(impl, instance=impl.instance.with_config(config), variant=label)


def all_for(
  spec: op_lib.OpSpec,
  profile: hardware.Profile | None = None,
  variants: Mapping[str, Mapping[str, dict]] | None = None,
) -> list[Implementation]:
  """Every registered implementation of `spec` resolved for `profile`, then each variant.

  Args:
    spec: The op's declaration.
    profile: The hardware (default: here).
    variants: Implementation name -> {label: config fields}: fixed configs
      listed after the default ones (the op database's `config_variants`).

  Returns:
    The implementations.
  """
  impls = [resolve(spec, name, profile) for name in spec.implementations]
  by_name = {i.name: i for i in impls}
  for name, labelled in (variants or {}).items():
    if name not in by_name:
      raise ValueError(f"{spec.name}: config variants for unknown implementation {name!r}")
    impls += [with_variant(by_name[name], label, fields) for label, fields in labelled.items()]
  return impls
