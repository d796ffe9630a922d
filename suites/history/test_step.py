"""bench.step: the README step's formulations agree, and its records follow bench.records."""

import json

import jax
import jax.numpy as jnp

from bench import records, step
from tokamax_harness import compare


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
    # float32 matmuls may run as TF32 on a GPU (each formulation its own): the harness's
    # float32 rule for matmul ops, over the attention's longest reduction (keys x head dim).
    close = dict(dtype=jnp.float32, has_matmul=True, reduction_length=t * h)
    compare.assert_close(value, want_value, name=f"{name} value", **close)
    for i, (got, want) in enumerate(zip(grads, want_grads, strict=True)):
      compare.assert_close(got, want, name=f"{name} gradient {i}", gradient=True, **close)


def test_the_records_follow_the_schema(tmp_path):
  out = tmp_path / "step.json"
  assert step.main(["--shape", "1,32,2,8", "--dtype", "float32", "--out", str(out)]) == 0
  obj = json.loads(out.read_text())
  assert records.validate(obj) == []
  assert {r["implementation"] for r in obj["records"]} == {"jnp", "xla", "None"}
  assert all(r["op"] == "training_step" and r["mode"] == "fwd_bwd" for r in obj["records"])
