"""The one table of op declarations: every op the library has, by name."""

from collections.abc import Mapping

from tokamax._src.ops import op
from tokamax._src.ops.attention import spec as attention_spec
from tokamax._src.ops.gated_linear_unit import spec as glu_spec
from tokamax._src.ops.linear_softmax_cross_entropy_loss import spec as loss_spec
from tokamax._src.ops.normalization import spec as norm_spec
from tokamax._src.ops.ragged_dot import spec as ragged_dot_spec

SPECS: Mapping[str, op.OpSpec] = {
  s.name: s
  for s in (
    attention_spec.SPEC,
    norm_spec.SPEC,
    glu_spec.SPEC,
    ragged_dot_spec.SPEC,
    loss_spec.SPEC,
  )
}


def spec(name: str) -> op.OpSpec:
  """The declaration of op `name`; `KeyError` naming the known ops otherwise."""
  if name not in SPECS:
    raise KeyError(f"unknown op {name!r}; known ops: {', '.join(SPECS)}")
  return SPECS[name]
