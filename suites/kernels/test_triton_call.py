"""The launch wrapper's batching: under `jax.vmap` a launch runs once per batch element."""

import jax
import jax.numpy as jnp
import numpy as np

from tokamax._src import triton_call


def test_vmap_runs_the_launch_per_element_and_passes_unbatched_arguments_whole():
  seen_shapes = []

  def launch(x, w):  # Stands in for a kernel launch that has no batching rule.
    seen_shapes.append((x.shape, w.shape))
    return [x @ w, jnp.sum(x, axis=-1)]

  f = triton_call.sequential_under_vmap(launch)
  rng = np.random.default_rng(0)
  xs = jnp.asarray(rng.standard_normal((3, 4, 5)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((5, 6)), jnp.float32)
  got = jax.jit(jax.vmap(f, in_axes=(0, None)))(xs, w)
  for i in range(3):
    np.testing.assert_allclose(got[0][i], np.asarray(xs[i]) @ np.asarray(w), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1][i], np.asarray(xs[i]).sum(-1), rtol=1e-5, atol=1e-5)
  assert seen_shapes and all(s == ((4, 5), (5, 6)) for s in seen_shapes), seen_shapes
  # Batched on the second axis, and nested vmaps.
  got = jax.vmap(jax.vmap(f, in_axes=(1, None)), in_axes=(0, None))(xs[:, :, None], w)
  np.testing.assert_allclose(got[0][:, 0], np.asarray(xs) @ np.asarray(w), rtol=1e-5, atol=1e-5)
