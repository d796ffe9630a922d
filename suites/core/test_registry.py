"""The op registry: one table of specs, consistent with the public API and the classes."""

import dataclasses
import importlib
import typing

import pytest

import tokamax
from suites import opdb
from tokamax._src.autotuning import configs
from tokamax._src.ops import registry

# (op name, implementation name) for every registered implementation.
_IMPLEMENTATIONS = [(s.name, i) for s in registry.SPECS.values() for i in s.implementations]


def _api_module(spec):
  """The public api module next to the spec's module (`.../<op>/spec.py` -> `.../<op>/api.py`)."""
  package = spec.canonicalize.__module__.rpartition(".")[0]
  return importlib.import_module(f"{package}.api")


def test_registry_is_keyed_by_spec_name():
  assert set(registry.SPECS) == {
    "dot_product_attention",
    "layer_norm",
    "gated_linear_unit",
    "ragged_dot",
    "linear_softmax_cross_entropy_loss",
  }
  for name, spec in registry.SPECS.items():
    assert spec.name == name
    assert registry.spec(name) is spec


def test_unknown_op_names_the_known_ones():
  with pytest.raises(KeyError, match=r"unknown op 'nope'.*layer_norm"):
    registry.spec("nope")


@pytest.mark.parametrize("name", list(registry.SPECS))
def test_public_implementation_literal_matches_registry(name):
  spec = registry.SPECS[name]
  literal = typing.get_args(_api_module(spec).Implementation)
  assert literal == tuple(spec.implementations), (
    f"{name}: api.Implementation {literal} != registered {tuple(spec.implementations)}"
  )


@pytest.mark.parametrize(("name", "implementation"), _IMPLEMENTATIONS)
def test_registered_class_names_its_spec_and_key(name, implementation):
  spec = registry.SPECS[name]
  try:
    cls = spec.implementation_class(implementation)
  except ImportError as e:
    pytest.skip(f"{spec.implementations[implementation]} does not import here: {e}")
  assert cls.spec is spec, f"{cls.__qualname__}.spec is {cls.spec.name}, not {name}"
  assert cls.name == implementation, f"{cls.__qualname__}.name {cls.name!r} != {implementation!r}"


def test_public_attention_implementation_alias_lists_the_attention_implementations():
  """`tokamax.DotProductAttentionImplementation` is attention's literal, not another op's (the
  ragged_dot literal also holds "mosaic")."""
  literal = typing.get_args(tokamax.DotProductAttentionImplementation)
  assert literal == tuple(registry.SPECS["dot_product_attention"].implementations)


@pytest.mark.parametrize("name", list(registry.SPECS))
def test_canonical_records_are_frozen(name):
  """A validated record cannot change in place (`arguments.op_arguments` freezes it)."""
  cls = typing.get_type_hints(registry.SPECS[name].canonicalize)["return"]
  record = object.__new__(cls)
  with pytest.raises(dataclasses.FrozenInstanceError):
    setattr(record, dataclasses.fields(cls)[0].name, None)


@pytest.mark.parametrize(("name", "implementation"), _IMPLEMENTATIONS)
def test_configs_decode_through_the_declared_config_class(name, implementation):
  """Cached configs are JSON decoded through `config_cls`: the heuristics' config and every
  autotuning candidate are instances of it and come back equal."""
  spec = registry.SPECS[name]
  cls = spec.implementation_class_or_reason(implementation)
  if isinstance(cls, str):
    pytest.skip(f"{name}[{implementation}] does not import here: {cls}")
  record = opdb.get(name).abstract_record()
  op = cls()
  for config in (op._get_heuristics_config(record), *op._get_autotuning_configs(record)):
    assert isinstance(config, cls.config_cls), f"{type(config).__name__} from {cls.__qualname__}"
    assert configs.decode(cls.config_cls, configs.encode(config)) == config
