"""cuDNN attention's guard for rows that see no key: zero output and zero cotangent there.

cuDNN itself runs only on NVIDIA GPUs (the matrix's `empty_rows` feature checks it there);
the guard is plain JAX and is checked here against a hand-made expectation.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax._src.ops.attention import cudnn

B, T, S, N, H = 2, 6, 5, 3, 4


@pytest.mark.parametrize("mask_shape", [(B, 1, T, S), (1, N, T, S), (B, N, T, S)])
def test_hidden_rows_get_zero_output_and_zero_cotangent(mask_shape):
  mask = np.random.default_rng(0).random(mask_shape) < 0.7
  mask[..., 2, :] = False  # Row 2 sees no key for every batch and head.
  mask[..., 4, :] = True
  out = jax.random.normal(jax.random.key(0), (B, T, N, H))
  dout = jax.random.normal(jax.random.key(1), (B, T, N, H))
  y, vjp = jax.vjp(lambda o: cudnn._zero_hidden_rows(o, jnp.asarray(mask)), out)
  (dx,) = vjp(dout)
  visible = np.broadcast_to(np.moveaxis(mask.any(-1), -1, 1)[..., None], out.shape)
  np.testing.assert_array_equal(np.asarray(y), np.where(visible, out, 0.0))
  np.testing.assert_array_equal(np.asarray(dx), np.where(visible, dout, 0.0))
  assert not np.asarray(y)[:, 2].any() and np.asarray(y)[:, 4].all()
