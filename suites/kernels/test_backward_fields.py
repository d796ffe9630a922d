"""Each kernel config's `BACKWARD_FIELDS` are fields its forward pass never reads.

Autotuning a forward alone keeps one candidate per forward program
(`Op._forward_config` sets those fields as the heuristics do), so a forward that
read one of them would be tuned on configs it never ran. Here every registered
implementation whose config declares them traces its forward (`_fwd_primal`, what
runs when no gradient is taken) with those fields poisoned: any use (arithmetic,
comparison, conversion, formatting) raises. The forward rule under differentiation
(`_fwd`) may read them: the Mosaic GPU loss's `gradient_in_forward` is such a field.
"""

import dataclasses

import jax
import pytest

from suites import opdb
from tokamax._src import triton_call
from tokamax._src.ops.attention import spec as attention_spec
from tokamax._src.ops.linear_softmax_cross_entropy_loss import spec as loss_spec
from tokamax._src.ops.normalization import spec as norm_spec


class PoisonUsedError(Exception):
  pass


class Poison:
  """A config value whose every use raises `PoisonUsedError` (hashing aside)."""

  def _used(self, *args, **kwargs):
    raise PoisonUsedError

  __index__ = __int__ = __float__ = __bool__ = __format__ = _used
  __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _used
  __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __neg__ = _used
  __floordiv__ = __rfloordiv__ = __truediv__ = __rtruediv__ = __mod__ = __rmod__ = _used
  __pow__ = __rpow__ = __and__ = __rand__ = __or__ = __ror__ = _used

  def __hash__(self):
    return id(self)


# Ops with configs that declare backward fields (their `opdb` abstract calls are traced).
_SPECS = (attention_spec.SPEC, norm_spec.SPEC, loss_spec.SPEC)


def _implementations_with_backward_fields():
  for spec in _SPECS:
    for name in spec.implementation_names:
      cls = spec.implementation_class_or_reason(name)
      if isinstance(cls, str) or cls.config_cls is None:
        continue
      if getattr(cls.config_cls, "BACKWARD_FIELDS", ()):
        yield pytest.param(spec, cls, id=f"{spec.name}-{name}")


CASES = list(_implementations_with_backward_fields())


def _poisoned(config, names):
  config = dataclasses.replace(config)
  for name in names:
    object.__setattr__(config, name, Poison())
  return config


def _trace_forward(op, record, config):
  with triton_call.capture():  # Triton launches are recorded, not run.
    jax.eval_shape(lambda r: op._fwd_primal(r, config), record)


def test_every_config_with_backward_fields_is_checked():
  want = {
    "dot_product_attention-mosaic",
    "dot_product_attention-triton",
    "dot_product_attention-mosaic_tpu",
    "layer_norm-triton",
    "linear_softmax_cross_entropy_loss-mosaic",
    "linear_softmax_cross_entropy_loss-mosaic_tpu",
  }
  assert want <= {p.id for p in CASES}


@pytest.mark.parametrize(("spec", "cls"), CASES)
def test_forward_never_reads_backward_fields(spec, cls):
  record = opdb.get(spec.name).abstract_record()
  op = cls()
  config = op._get_heuristics_config(record)
  backward = cls.config_cls.BACKWARD_FIELDS
  assert set(backward) <= {f.name for f in dataclasses.fields(config)}
  _trace_forward(op, record, _poisoned(config, backward))
  # The poison has teeth: the first forward field is read.
  forward = next(f.name for f in dataclasses.fields(config) if f.name not in backward)
  with pytest.raises(PoisonUsedError):
    _trace_forward(op, record, _poisoned(config, [forward]))
