"""Every op under jit, grad and vmap, and on 8 sharded host devices."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import tokamax
from suites.core.conftest import assert_matches


def _op_calls(inputs):
  """(name, function of float arrays, arrays) for each op."""
  q, k, v = inputs.normal((2, 12, 4, 8)), inputs.normal((2, 12, 2, 8)), inputs.normal((2, 12, 2, 8))
  x, w = inputs.normal((6, 16)), inputs.normal((16, 2, 8))
  sizes = jnp.array([2, 0, 4], jnp.int32)
  labels = jnp.array([1, 0, 3, 7, 2, 5])
  return {
    "attention": (
      lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=True),
      (q, k, v),
    ),
    "attention_chunked": (
      lambda q, k, v: tokamax.dot_product_attention(q, k, v, implementation="xla_chunked"),
      (q, k, v),
    ),
    "layer_norm": (lambda x: tokamax.layer_norm(x, None, None, subtract_mean=False), (x,)),
    "glu": (lambda x, w: tokamax.gated_linear_unit(x, w, activation=jax.nn.gelu), (x, w)),
    "ragged_dot": (lambda x, r: tokamax.ragged_dot(x, r, sizes), (x, inputs.normal((3, 16, 5)))),
    "loss": (
      lambda x, w: tokamax.linear_softmax_cross_entropy_loss(x, labels, w, reduction="none"),
      (x, inputs.normal((16, 9))),
    ),
    "loss_chunked": (
      lambda x, w: tokamax.linear_softmax_cross_entropy_loss(
        x, labels, w, implementation="chunked_xla"
      ),
      (x, inputs.normal((16, 9))),
    ),
  }


NAMES = (
  "attention",
  "attention_chunked",
  "layer_norm",
  "glu",
  "ragged_dot",
  "loss",
  "loss_chunked",
)


@pytest.mark.parametrize("name", NAMES)
def test_jit_of_grad_matches_eager(name, inputs):
  fn, args = _op_calls(inputs)[name]
  loss = lambda *a: (fn(*a) ** 2).sum()
  argnums = tuple(range(len(args)))
  eager = jax.grad(loss, argnums)(*args)
  jitted = jax.jit(jax.grad(loss, argnums))(*args)
  for a, b in zip(jitted, eager, strict=True):
    assert_matches(a, b)


@pytest.mark.parametrize("name", NAMES)
def test_vmap_matches_loop(name, inputs):
  fn, args = _op_calls(inputs)[name]
  stacked = [jnp.stack([a, a * 0.5 + 0.1, -a]) for a in args]
  batched = jax.vmap(fn)(*stacked)
  for i in range(3):
    assert_matches(batched[i], fn(*(s[i] for s in stacked)))
  grads = jax.vmap(jax.grad(lambda *a: fn(*a).sum(), tuple(range(len(args)))))(*stacked)
  single = jax.grad(lambda *a: fn(*a).sum(), tuple(range(len(args))))(*(s[1] for s in stacked))
  for g, r in zip(grads, single, strict=True):
    assert_matches(g[1], r)


def test_sharded_over_eight_host_devices():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  root = Path(__file__).resolve().parents[2]
  # This tree's tokamax, not an installed one (an editable install of another checkout).
  env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(root), env.get("PYTHONPATH", "")])
  result = subprocess.run(
    [sys.executable, "-m", "suites.core.sharding_checks"],
    cwd=root,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert "all sharded checks passed" in result.stdout
