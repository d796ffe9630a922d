"""Per-kernel CUPTI device time of training steps, ours against the anchors (H200).

Where the time of a forward or forward+backward step goes, kernel by kernel:
each case lists its kernels (median over iterations) and their sum. Cases
are named by what they profile; `--only` takes substrings of their names.

  python3 ci/gpu/kernel_profile.py --out kernel_profile.json [--only glu,attention]
"""

import argparse
import dataclasses
import functools
import os
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import run_record

import tokamax
from tokamax._src.ops.ragged_dot import spec as rd_spec

ITERATIONS = 5


def per_kernel_ms(fn: Callable, args: tuple) -> list[tuple[str, float]]:
  """(kernel name, median ms over iterations) for each kernel one call of `fn` runs."""
  from jax.experimental.mosaic.gpu import profiler

  measure = profiler.Cupti(finalize=False).measure(fn, aggregate=False, iterations=ITERATIONS)
  _, timings = measure(*args)
  if timings is None:
    return []
  names = [name for name, _ in timings[0]]
  return [(name, float(np.median([run[i][1] for run in timings]))) for i, name in enumerate(names)]


def _normal(key: int, shape, dtype=jnp.bfloat16, scale: float = 1.0):
  return (jax.random.normal(jax.random.key(key), shape, jnp.float32) * scale).astype(dtype)


def _step(fn: Callable, args: tuple, mode: str, diff_argnums: tuple[int, ...]):
  """(jitted step, its args): the forward, or a training step with a random cotangent."""
  if mode == "fwd":
    return jax.jit(fn), args
  out = jax.eval_shape(fn, *args)
  cotangent = _normal(99, out.shape, out.dtype)
  return jax.jit(run_record.forward_backward(fn, diff_argnums)), (*args, cotangent)


def glu_case(m, k, n, impl):
  x = _normal(0, (m, k))
  w = _normal(1, (k, 2, n), scale=1 / np.sqrt(k))
  fn = functools.partial(tokamax.gated_linear_unit, activation=jax.nn.swish, implementation=impl)
  return fn, (x, w), (0, 1)


def _overlapped_attention():
  """The Mosaic attention op with the overlapped consumers (`overlap_qk`, no schedule barrier)."""
  from tokamax._src.ops.attention import mosaic

  class Overlapped(mosaic.MosaicAttention):
    def _get_heuristics_config(self, args):
      config = super()._get_heuristics_config(args)
      return dataclasses.replace(config, overlap_qk=True, schedule_barrier=False)

  return Overlapped()


def attention_case(b, t, n, h, impl, causal=False, kv_heads=None):
  impl = _overlapped_attention() if impl == "mosaic-overlap" else impl
  q = _normal(0, (b, t, n, h))
  k = _normal(1, (b, t, kv_heads or n, h))
  v = _normal(2, (b, t, kv_heads or n, h))
  fn = functools.partial(tokamax.dot_product_attention, is_causal=causal, implementation=impl)
  return fn, (q, k, v), (0, 1, 2)


def ragged_case(m, k, n, g, sizes_kind, impl="mosaic"):
  sizes = {
    "equal": np.full(g, m // g, np.int32),
    "uneven": rd_spec.generate_ragged_dot_group_sizes(m, g, seed=1),
  }
  if sizes_kind == "uneven128":  # Uneven, each size rounded to 128 rows: no partial tiles.
    raw = rd_spec.generate_ragged_dot_group_sizes(m // 128, g, seed=1)
    sizes[sizes_kind] = np.asarray(raw, np.int32) * 128
  group_sizes = jnp.asarray(sizes[sizes_kind], jnp.int32)
  lhs = _normal(0, (m, k))
  rhs = _normal(1, (g, k, n), scale=1 / np.sqrt(k))
  fn = lambda a, b: tokamax.ragged_dot(a, b, group_sizes, implementation=impl)
  return fn, (lhs, rhs), (0, 1)


def norm_case(m, d, impl, rms=True):
  x = _normal(0, (m, d))
  scale = _normal(1, (d,))
  fn = functools.partial(tokamax.layer_norm, subtract_mean=not rms, implementation=impl)
  return lambda a, s: fn(a, s, None), (x, scale), (0, 1)


CASES = {
  **{
    f"glu {impl} {mode} 8192x4096x14336": (glu_case, (8192, 4096, 14336, impl), mode)
    for impl in ("xla", "mosaic")
    for mode in ("fwd", "fwd+bwd")
  },
  **{
    f"attention {impl} {mode} B{b} T{t} N{n} H{h}{' causal' if c else ''}": (
      attention_case,
      (b, t, n, h, impl, c),
      mode,
    )
    for impl in ("cudnn", "mosaic")
    for b, t, n, h, c in (
      (4, 4096, 32, 128, False),
      (32, 2048, 16, 64, False),
      (2, 8192, 8, 256, True),
    )
    for mode in ("fwd", "fwd+bwd")
  },
  **{
    f"attention mosaic-overlap {mode} B4 T4096 N32 H128": (
      attention_case,
      (4, 4096, 32, 128, "mosaic-overlap"),
      mode,
    )
    for mode in ("fwd", "fwd+bwd")
  },
  **{
    f"ragged mosaic {mode} M32768 K7168 N2048 G64 {kind}": (
      ragged_case,
      (32768, 7168, 2048, 64, kind),
      mode,
    )
    for kind in ("equal", "uneven", "uneven128")
    for mode in ("fwd", "fwd+bwd")
  },
  **{
    f"rms_norm {impl} fwd+bwd 4096x8192": (norm_case, (4096, 8192, impl), "fwd+bwd")
    for impl in ("xla", "triton")
  },
}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default="kernel_profile.json")
  parser.add_argument("--only", default="", help="comma-separated substrings of case names")
  parser.add_argument("--hlo", action="store_true", help="save each case's optimised HLO")
  flags = parser.parse_args()
  wanted = [s for s in flags.only.split(",") if s]
  record = run_record.Record(flags.out, iterations=ITERATIONS, cases={})
  record.results["device"] = jax.devices()[0].device_kind

  record.results["commit"] = os.environ.get("TOKAMAX_COMMIT")

  @record.guarded
  def profile(name, make, make_args, mode):
    fn, args, diff_argnums = make(*make_args)
    step, step_args = _step(fn, args, mode, diff_argnums)
    kernels = per_kernel_ms(step, step_args)
    if flags.hlo:
      path = os.path.join(os.path.dirname(flags.out) or ".", f"hlo_{name.replace(' ', '_')}.txt")
      with open(path, "w") as f:
        f.write(step.lower(*step_args).compile().as_text())
    total = sum(ms for _, ms in kernels)
    record.results["cases"][name] = {
      "total_ms": total,
      "kernels": [{"name": k, "ms": ms} for k, ms in kernels],
    }
    record.log(f"{name}: {total:.3f} ms in {len(kernels)} kernels")
    for k, ms in sorted(kernels, key=lambda kv: -kv[1])[:12]:
      record.log(f"    {ms:8.3f}  {k[:110]}")
    record.save()

  for name, (make, make_args, mode) in CASES.items():
    if not wanted or any(w in name for w in wanted):
      profile(name, make, make_args, mode)
  record.save()


if __name__ == "__main__":
  main()
