"""Every op on inputs sharded over 8 host devices; run by test_transforms in a subprocess.

Usage: XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m suites.core.sharding_checks
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import tokamax
from tokamax_harness import references


def _close(a, b, what):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  err = np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)
  assert err < 1e-5, f"{what}: relative error {err}"
  print(f"ok {what}")


def main() -> None:
  assert jax.device_count() == 8, jax.devices()
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, PartitionSpec(*spec)))
  keys = iter(jax.random.split(jax.random.key(0), 16))
  normal = lambda *shape: jax.random.normal(next(keys), shape)

  q, k, v = normal(8, 16, 4, 8), normal(8, 16, 2, 8), normal(8, 16, 2, 8)
  for impl in ("xla", "xla_chunked"):
    f = jax.jit(
      jax.value_and_grad(
        lambda q, k, v: tokamax.dot_product_attention(
          q, k, v, is_causal=True, implementation=impl
        ).sum(),
        argnums=(0, 1, 2),
      )
    )
    sharded = f(put(q, "data"), put(k, "data"), put(v, "data"))
    plain = f(q, k, v)
    for i, (a, b) in enumerate(zip(jax.tree.leaves(sharded), jax.tree.leaves(plain), strict=True)):
      _close(a, b, f"attention[{impl}] sharded batch, leaf {i}")
    q_sharding = NamedSharding(mesh, PartitionSpec("data", None, "model", None))
    g = jax.jit(
      lambda q, k, v: tokamax.dot_product_attention(
        q, k, v, is_causal=True, implementation=impl, q_sharding=q_sharding
      )
    )
    _close(
      g(
        put(q, "data", None, "model"), put(k, "data", None, "model"), put(v, "data", None, "model")
      ),
      tokamax.dot_product_attention(q, k, v, is_causal=True),
      f"attention[{impl}] q_sharding",
    )
    # With a per-head bias, a mask broadcast over batch and heads, per-batch sequence lengths
    # and one K/V head (MQA, not split): each shard gets its slice of each, or all of it.
    side = iter(jax.random.split(jax.random.key(1), 4))
    k1, v1 = (jax.random.normal(next(side), (8, 16, 1, 8)) for _ in range(2))
    bias = jax.random.normal(next(side), (8, 4, 16, 16))
    mask = jax.random.bernoulli(next(side), 0.8, (1, 1, 16, 16))
    features = dict(
      query_seq_lengths=jnp.array([16, 3, 9, 16, 1, 12, 16, 7]),
      key_value_seq_lengths=jnp.array([7, 16, 12, 1, 16, 9, 3, 16]),
      local_window_size=(5, 2),
    )
    h = jax.jit(
      lambda q, k, v, bias, mask: tokamax.dot_product_attention(
        q, k, v, bias, mask, implementation=impl, q_sharding=q_sharding, **features
      )
    )
    _close(
      h(put(q, "data", None, "model"), k1, v1, bias, mask),
      tokamax.dot_product_attention(q, k1, v1, bias, mask, implementation="xla", **features),
      f"attention[{impl}] q_sharding with bias, mask, lengths and one K/V head",
    )
    # A per-head bias [N, T, S] with no batch dims: each shard gets its own heads' rows.
    bias3 = jax.random.normal(jax.random.key(2), (4, 16, 16))
    _close(
      jax.jit(
        lambda q, k, v, b: tokamax.dot_product_attention(
          q, k, v, b, implementation=impl, q_sharding=q_sharding
        )
      )(put(q, "data", None, "model"), k, v, bias3),
      references.attention(q, k, v, bias3),
      f"attention[{impl}] q_sharding with a per-head bias of no batch dims",
    )

  # Two batch dims, each split, and a bias and lengths with one batch dim (the query's last,
  # as numpy aligns them): each shard gets the bias rows and lengths of its own last batch
  # index, not those of its first.
  q2 = normal(4, 4, 16, 4, 8)
  k2, v2 = normal(4, 4, 16, 2, 8), normal(4, 4, 16, 2, 8)
  bias2, lengths2 = normal(4, 1, 16, 16), jnp.array([16, 5, 11, 2])
  q_sharding2 = NamedSharding(mesh, PartitionSpec("data", "model", None, None, None))
  for impl in ("xla", "xla_chunked"):
    run = lambda q, k, v, bias, sharding, impl=impl: tokamax.dot_product_attention(
      q, k, v, bias, key_value_seq_lengths=lengths2, implementation=impl, q_sharding=sharding
    )
    _close(
      jax.jit(lambda q, k, v, bias: run(q, k, v, bias, q_sharding2))(q2, k2, v2, bias2),
      references.attention(q2, k2, v2, bias2, key_value_seq_lengths=lengths2),
      f"attention[{impl}] q_sharding over two batch dims, bias and lengths of the last one",
    )

  x = normal(16, 32)
  _close(
    jax.jit(lambda x: tokamax.layer_norm(x, None, None))(put(x, "data")),
    tokamax.layer_norm(x, None, None),
    "layer_norm",
  )
  w = normal(32, 2, 24)
  glu = jax.jit(
    jax.grad(
      lambda x, w: tokamax.gated_linear_unit(x, w, activation=jax.nn.swish).sum(), argnums=(0, 1)
    )
  )
  for a, b in zip(glu(put(x, "data"), put(w, None, None, "model")), glu(x, w), strict=True):
    _close(a, b, "gated_linear_unit grad")
  sizes = jnp.array([4, 0, 7, 5], jnp.int32)
  rhs = normal(4, 32, 8)
  rd = jax.jit(jax.grad(lambda x, r: tokamax.ragged_dot(x, r, sizes).sum(), argnums=(0, 1)))
  for a, b in zip(rd(put(x, "data"), put(rhs, None, None, "model")), rd(x, rhs), strict=True):
    _close(a, b, "ragged_dot grad")
  labels = jnp.arange(16) % 24
  wl = normal(32, 24)
  for impl in ("xla", "chunked_xla"):
    loss = jax.jit(
      jax.grad(
        lambda x, w: tokamax.linear_softmax_cross_entropy_loss(x, labels, w, implementation=impl),
        argnums=(0, 1),
      )
    )
    for a, b in zip(loss(put(x, "data"), put(wl, None, "model")), loss(x, wl), strict=True):
      _close(a, b, f"loss[{impl}] grad")
  print("all sharded checks passed")


if __name__ == "__main__":
  main()
