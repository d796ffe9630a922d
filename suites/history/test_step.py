"""bench.step: the README step's formulations agree, and its records follow bench.records."""

import json

import jax
import jax.numpy as jnp

from bench import records, step
from tokamax_harness import compare, references


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


def _reference_loss(x, scales, heads):
  """The README step written out by hand: LayerNorm (epsilon 1e-6, no offset) and causal
  softmax attention with q = k = v, twice, then the mean square."""

  def layer_norm(x, scale):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-6) * scale

  def attention(h):
    b, t, _ = h.shape
    q = h.reshape(b, t, heads, -1)
    logits = jnp.einsum("bqnd,bknd->bnqk", q, q) / jnp.sqrt(q.shape[-1])
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -jnp.inf)
    return jnp.einsum("bnqk,bknd->bqnd", jax.nn.softmax(logits, axis=-1), q).reshape(h.shape)

  h = attention(layer_norm(x, scales[0]))
  h = attention(layer_norm(h, scales[1]))
  return jnp.mean(jnp.square(h))


def test_the_step_is_the_readme_model():
  # Each layer_norm has its own scale: the second scale's gradient is the reference's too.
  b, t, n, h = 1, 16, 2, 8
  keys = jax.random.split(jax.random.key(2), 2)
  x = jax.random.normal(keys[0], (b, t, n * h), jnp.float32)
  scales = 1.0 + 0.3 * jax.random.normal(keys[1], (2, n * h))
  want_value, want_grads = jax.value_and_grad(_reference_loss, argnums=(0, 1))(x, scales, n)
  close = dict(dtype=jnp.float32, has_matmul=True, reduction_length=t * h)
  for name in ("jnp", None):
    value, grads = jax.value_and_grad(step.step(name, n), argnums=(0, 1))(x, scales)
    compare.assert_close(value, want_value, name=f"{name} value", **close)
    for i, (got, want) in enumerate(zip(grads, want_grads, strict=True)):
      compare.assert_close(got, want, name=f"{name} gradient {i}", gradient=True, **close)


def test_the_records_carry_each_time_and_the_jnp_anchor(tmp_path, monkeypatch):
  # Timed (in this order) jnp, xla, the default: 4, 2 and 1 ms; nothing is run.
  times = iter((0.004, 0.002, 0.001))
  monkeypatch.setattr(
    step.timing,
    "device_time",
    lambda fn, args_list, **kw: step.timing.Timing((next(times),), "wallclock"),
  )
  out = tmp_path / "step.json"
  assert step.main(["--shape", "2,32,4,8", "--dtype", "float32", "--out", str(out)]) == 0
  recs = {r["implementation"]: r for r in json.loads(out.read_text())["records"]}
  assert {k: r["median_ms"] for k, r in recs.items()} == {"jnp": 4.0, "xla": 2.0, "None": 1.0}
  assert all(r["anchor"] == "jnp" and r["anchor_ms"] == 4.0 for r in recs.values())
  assert all(r["shape"] == {"b": 2, "t": 32, "n": 4, "h": 8} for r in recs.values())
  assert all(r["method"] == "wallclock" and r["dtype"] == "float32" for r in recs.values())


def test_the_plain_layer_norm_takes_epsilon_1e_minus_6():
  # Inputs of variance 1e-6, as small as epsilon: a different epsilon moves the normalization.
  b, t, n, h = 1, 8, 2, 8
  keys = jax.random.split(jax.random.key(3), 2)
  x = 1e-3 * jax.random.normal(keys[0], (b, t, n * h), jnp.float32)
  scale = 1.0 + 0.3 * jax.random.normal(keys[1], (n * h,))
  want = references.layer_norm(x, scale, None, epsilon=1e-6)
  compare.assert_close(step._plain_layer_norm(x, scale), want, dtype=jnp.float32)


def test_main_times_the_value_and_both_gradients_over_distinct_inputs(tmp_path, monkeypatch):
  # Each formulation is timed as value_and_grad in (x, scales), rotating over distinct inputs.
  b, t, n, h = 1, 16, 2, 8
  timed = []

  def device_time(fn, args_list, **kw):
    timed.append((fn, args_list))
    return step.timing.Timing((0.001,), "wallclock")

  monkeypatch.setattr(step.timing, "device_time", device_time)
  assert step.main(["--shape", f"{b},{t},{n},{h}", "--dtype", "float32"]) == 0
  assert len(timed) == 3
  close = dict(dtype=jnp.float32, has_matmul=True, reduction_length=t * h)
  for fn, args_list in timed:
    assert len(args_list) >= 2
    assert not jnp.array_equal(args_list[0][0], args_list[1][0])
    x, scales = args_list[0]
    want_value, want_grads = jax.value_and_grad(_reference_loss, argnums=(0, 1))(x, scales, n)
    value, grads = fn(x, scales)
    compare.assert_close(value, want_value, name="value", **close)
    assert len(grads) == 2
    for got, want in zip(grads, want_grads, strict=True):
      compare.assert_close(got, want, name="gradient", gradient=True, **close)
