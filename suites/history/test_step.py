"""bench.step: the README step's formulations agree, and its records follow bench.records."""

import json

import jax
import jax.numpy as jnp
import numpy as np

from bench import records, step


def test_the_step_formulations_agree_in_value_and_gradient():
  b, t, n, h = 1, 32, 2, 8
  keys = jax.random.split(jax.random.key(1), 2)
  x = jax.random.normal(keys[0], (b, t, n * h), jnp.float32) + 0.5
  scales = 1.0 + 0.1 * jax.random.normal(keys[1], (2, n * h))
  results = {
    name: jax.value_and_grad(step.step(name, n), argnums=(0, 1))(x, scales)
    for name in ("jnp", "xla", None)
  }
  want_value, want_grads = results["jnp"]
  for name in ("xla", None):
    value, grads = results[name]
    np.testing.assert_allclose(value, want_value, rtol=1e-5, err_msg=str(name))
    for got, want in zip(grads, want_grads, strict=True):
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=str(name))


def test_the_records_follow_the_schema(tmp_path):
  out = tmp_path / "step.json"
  assert step.main(["--shape", "1,32,2,8", "--dtype", "float32", "--out", str(out)]) == 0
  obj = json.loads(out.read_text())
  assert records.validate(obj) == []
  assert {r["implementation"] for r in obj["records"]} == {"jnp", "xla", "None"}
  assert all(r["op"] == "training_step" and r["mode"] == "fwd_bwd" for r in obj["records"])
