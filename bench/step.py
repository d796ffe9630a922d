"""The README example's training step, timed: the ops together as a model calls them.

layer_norm -> causal attention -> layer_norm -> causal attention -> mean square, forward
and gradient (issue 24's yardstick: the step with `implementation="xla"` against the same
step written in plain jnp and `jax.nn.dot_product_attention`), as bench.records:

  python -m bench.step [--shape 8,4096,16,128] [--dtype bfloat16] [--out FILE]
"""

import argparse
import datetime
import json
import os

import jax
import jax.numpy as jnp

import tokamax
from bench import cases, records
from tokamax_harness import timing


def _plain_layer_norm(x, scale):
  """The op database's plain jnp LayerNorm (the benchmark runner's `jnp` anchor)."""
  kwargs = dict(axis=-1, epsilon=1e-6, scale_offset=0.0, subtract_mean=True)
  return cases.anchors("layer_norm")["jnp"]((x, scale, None), kwargs)


def step(implementation: str | None, heads: int):
  """The step's loss of (x [B, T, N*H], scales [2, N*H]); "jnp" is the plain formulation."""

  def layer_norm(x, scale):
    if implementation == "jnp":
      return _plain_layer_norm(x, scale)
    return tokamax.layer_norm(x, scale, None, implementation=implementation)

  def attention(h):
    q = h.reshape(*h.shape[:2], heads, -1)
    if implementation == "jnp":
      out = jax.nn.dot_product_attention(q, q, q, is_causal=True, implementation="xla")
    else:
      out = tokamax.dot_product_attention(q, q, q, is_causal=True, implementation=implementation)
    return out.reshape(h.shape)

  def loss(x, scales):
    h = attention(layer_norm(x, scales[0]))
    h = attention(layer_norm(h, scales[1]))
    return jnp.mean(jnp.square(h.astype(jnp.float32)))

  return loss


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", default="8,4096,16,128", help="B,T,N,H")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  b, t, n, h = (int(s) for s in args.shape.split(","))
  keys = jax.random.split(jax.random.key(0), 4)
  inputs = [
    (
      jax.random.normal(keys[i], (b, t, n * h), jnp.float32).astype(args.dtype),
      (1.0 + 0.1 * jax.random.normal(keys[i + 2], (2, n * h))).astype(args.dtype),
    )
    for i in range(2)
  ]
  times = {}
  for implementation in ("jnp", "xla", None):
    fn = jax.jit(jax.value_and_grad(step(implementation, n), argnums=(0, 1)))
    times[str(implementation)] = timing.device_time(fn, inputs, iterations=20)
    print(f"step {implementation}: {times[str(implementation)].median_ms:.3f} ms", flush=True)
  device = jax.devices()[0].device_kind
  out = [
    records.Record(
      device=device,
      commit=os.environ.get("TOKAMAX_COMMIT", "unknown"),
      date=datetime.date.today().isoformat(),
      op="training_step",
      implementation=name,
      case=f"B{b} T{t} N{n} H{h} layer_norm, causal attention x2",
      shape=dict(b=b, t=t, n=n, h=h),
      dtype=args.dtype,
      mode="fwd_bwd",
      median_ms=tm.median_ms,
      anchor="jnp",
      anchor_ms=times["jnp"].median_ms,
      method=tm.method,
    ).as_dict()
    for name, tm in times.items()
  ]
  if args.out:
    with open(args.out, "w") as f:
      json.dump(
        {"schema": records.SCHEMA_VERSION, "note": "bench.step", "records": out}, f, indent=1
      )
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
