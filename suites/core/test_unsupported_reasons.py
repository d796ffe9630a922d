"""Every implementation answers "can you take this call?" on edge shapes with a reason or None.

Empty and one-element dimensions, through each op's canonicalize and each implementation's
`_unsupported_reason` (device-independent): a check that raises instead (the Mosaic TPU loss's
divided by B = 0) would crash `implementation=None` rather than fall back to XLA.
"""

import jax.numpy as jnp
import pytest

from tokamax._src.ops.attention import spec as attention
from tokamax._src.ops.gated_linear_unit import spec as glu
from tokamax._src.ops.linear_softmax_cross_entropy_loss import spec as loss
from tokamax._src.ops.normalization import spec as norm
from tokamax._src.ops.ragged_dot import spec as ragged

BF16 = jnp.bfloat16


def _ones(*shape):
  return jnp.ones(shape, BF16)


EDGE_CALLS = {
  attention.SPEC: [
    (_ones(1, t, 2, 64), _ones(1, s, 2, 64), _ones(1, s, 2, 64))
    for t, s in ((1, 1), (0, 3), (3, 0), (1, 7))
  ],
  norm.SPEC: [(_ones(*shape), None, None) for shape in ((0, 64), (4, 0), (1, 1), (3, 5))],
  glu.SPEC: [
    (_ones(m, k), _ones(k, 2, n)) for m, k, n in ((0, 64, 64), (4, 0, 64), (4, 64, 0), (1, 1, 1))
  ],
  ragged.SPEC: [
    (_ones(m, k), _ones(g, k, n), jnp.zeros((g,), jnp.int32).at[0].set(m))
    for m, k, n, g in ((0, 8, 8, 1), (4, 8, 8, 1), (1, 1, 1, 1), (4, 8, 8, 3), (4, 0, 8, 2))
  ],
  loss.SPEC: [
    (_ones(b, h), jnp.zeros((b,), jnp.int32), _ones(h, v))
    for b, h, v in ((0, 128, 512), (256, 0, 512), (1, 1, 1), (3, 5, 7))
  ],
}
CASES = [
  pytest.param(spec, name, i, id=f"{spec.name}-{name}-{i}")
  for spec, calls in EDGE_CALLS.items()
  for name in spec.implementations
  for i in range(len(calls))
]


@pytest.mark.parametrize(("spec", "name", "i"), CASES)
def test_reason_or_none_on_edge_shapes(spec, name, i):
  record = spec.canonicalize(*EDGE_CALLS[spec][i])
  reason = spec.implementation_class(name)()._unsupported_reason(record)
  assert reason is None or (isinstance(reason, str) and reason), repr(reason)
