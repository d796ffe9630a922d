"""Timed benchmarks of the family's `BENCH` calls: device time, TFLOP/s, GB/s.

Run with `--bench` (`nox -s bench`); `--benchmark-json` then carries each
measurement's device time in `extra_info`.
"""

import jax
import jax.numpy as jnp
import pytest

from suites.matrices import checks
from tokamax_harness import bench, grads, timing

ROTATIONS = 3


def _function(case, impl, args, kwargs, mode):
  f, primals = case.differentiable(impl, args, kwargs)
  if mode == "fwd":
    return jax.jit(f), primals
  out = jax.eval_shape(f, *primals)
  cotangent = grads.random_like(jax.random.key(0), jnp.zeros(out.shape, out.dtype))
  return jax.jit(lambda *p: jax.vjp(f, *p)[1](cotangent)), primals


@pytest.mark.bench
@pytest.mark.matrix("bench")
def test_bench(bench_case, impl, benchmark):
  case, mode = bench_case.case, bench_case.mode
  args, kwargs = case.make_args(checks.case_key(case))
  checks.skip_unsupported(impl, args, kwargs)
  fn, primals = _function(case, impl, args, kwargs, mode)
  rotated = [primals] + [
    case.differentiable(impl, *case.make_args(jax.random.key(i)))[1] for i in range(1, ROTATIONS)
  ]
  result = timing.device_time(fn, rotated, warmup=3, iterations=20)
  m = bench.measurement(
    op=case.op,
    implementation=impl.name,
    case=case.id,
    mode=mode,
    shapes=case.shape_dict,
    dtype=case.dtype,
    result=result,
    cost=case.cost(args, kwargs),
  )
  bench.record(benchmark, m)
  benchmark.pedantic(lambda: jax.block_until_ready(fn(*primals)), rounds=3, iterations=1)
