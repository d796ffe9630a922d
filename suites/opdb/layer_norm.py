"""layer_norm (LayerNorm and RMSNorm) in the op database."""

import jax
import jax.numpy as jnp
from hypothesis import strategies as st

from suites.opdb import base
from suites.opdb import kernel_cases as kc
from tokamax_harness import references


def build(d: base.Draw, shape: dict, dtype: str, f: dict) -> base.Built:
  rows, dim = shape["rows"], shape["d"]
  axis = f.get("axis", -1)
  x_shape = (dim, *rows) if axis == 0 else (*rows, dim)
  # An offset mean makes mean subtraction matter.
  x = (d.normal(x_shape, jnp.float32) + 0.5).astype(dtype)
  scale = None if f.get("no_scale") else (1.0 + d.normal((dim,), jnp.float32, 0.2)).astype(dtype)
  offset = None if f.get("no_offset") else d.normal((dim,), dtype, 0.2)
  kwargs = {
    "axis": axis,
    "epsilon": f.get("epsilon", 1e-6),
    "scale_offset": f.get("scale_offset", 0.0),
    "subtract_mean": not f.get("rms", False),
  }
  diff = (0,) + ((1,) if scale is not None else ()) + ((2,) if offset is not None else ())
  return base.Built((x, scale, offset), kwargs, diff, ("x", "scale", "offset"))


def _plain_jnp(args: tuple, kwargs: dict):
  """LayerNorm/RMSNorm as a user writes it in jnp (statistics in float32): #24's yardstick."""
  x, scale, offset = args
  axis, eps = kwargs["axis"], kwargs["epsilon"]
  x32 = x.astype(jnp.float32)
  if kwargs["subtract_mean"]:
    x32 = x32 - x32.mean(axis, keepdims=True)
  y = x32 * jax.lax.rsqrt((x32 * x32).mean(axis, keepdims=True) + eps)
  shape = [1] * x.ndim
  shape[axis] = x.shape[axis]
  if scale is not None:
    y = y * (scale.astype(jnp.float32) + kwargs["scale_offset"]).reshape(shape)
  if offset is not None:
    y = y + offset.astype(jnp.float32).reshape(shape)
  return y.astype(x.dtype)


def _sizes():
  return st.fixed_dictionaries(dict(rows=st.tuples(st.integers(1, 6)), d=st.integers(1, 300)))


_GPU = base.Matrix(
  shapes=(dict(rows=(4, 512), d=1024), dict(rows=(300,), d=4097)),
  dtypes=("bfloat16", "float32"),
  long_shapes=(dict(rows=(8192,), d=8192),),
)
# The cases of docs/perf.md.
_GPU_BENCH = (
  base.BenchCall(dict(rows=(16384,), d=4096), "bfloat16", "plain"),
  base.BenchCall(dict(rows=(16384,), d=4096), "bfloat16", "rms"),
  base.BenchCall(dict(rows=(4096,), d=8192), "bfloat16", "plain"),
  base.BenchCall(dict(rows=(4096,), d=8192), "bfloat16", "rms"),
)

# Kernel cases (`kernel_cases`): Triton's, run in its interpreter on CPU and compiled
# on a GPU (the "triton:gpu" ones on a GPU only, at each of the test's dtypes).
_KERNEL_CASES = {
  "triton": {
    "f32_rows_40": kc.LayerNormKernelCase((6, 40), -1, "float32", True, True, True, 0.0),
    "f16_rms_axis1_scale_offset_1": kc.LayerNormKernelCase(
      (3, 24, 5), 1, "float16", False, True, False, 1.0
    ),
    "f32_no_scale_scale_offset_half": kc.LayerNormKernelCase(
      (10, 100), -1, "float32", True, False, True, 0.5
    ),
    "f32_rms_axis2_bare": kc.LayerNormKernelCase(
      (4, 8, 130), 2, "float32", False, False, False, 0.0
    ),
  },
  "triton:gpu": {
    "wide_4096": kc.LayerNormKernelCase((32, 4096), -1, None, True, True, True, 0.0),
  },
  # Compiled on a GPU through the public API against XLA (suites/kernels/test_gpu_compiled.py).
  "triton:gpu_compiled": {
    "bf16_d1000": kc.LayerNormKernelCase((64, 1000), -1, "bfloat16", True, True, True, 0.0),
    "bf16_d1000_rms_offset_1": kc.LayerNormKernelCase(
      (64, 1000), -1, "bfloat16", False, True, False, 1.0
    ),
    "bf16_d1000_no_scale_offset_half": kc.LayerNormKernelCase(
      (64, 1000), -1, "bfloat16", True, False, True, 0.5
    ),
    "bf16_axis1": kc.LayerNormKernelCase((8, 300, 24), 1, "bfloat16", True, True, True, 0.0),
    "bf16_axis1_rms_offset_1": kc.LayerNormKernelCase(
      (8, 300, 24), 1, "bfloat16", False, True, False, 1.0
    ),
    "f16_d4096": kc.LayerNormKernelCase((4, 4096), -1, "float16", True, True, True, 0.0),
    "f16_d4096_rms_offset_1": kc.LayerNormKernelCase(
      (4, 4096), -1, "float16", False, True, False, 1.0
    ),
    "f32_d2000": kc.LayerNormKernelCase((33, 2000), -1, "float32", True, True, True, 0.0),
    "f32_d2000_rms_offset_1": kc.LayerNormKernelCase(
      (33, 2000), -1, "float32", False, True, False, 1.0
    ),
    # Rows of 8192 and more rows than the heuristics' 528 persistent forward programs (1000:
    # some programs take two rows), and the backward pipelined through shared memory.
    "bf16_d8192_persistent": kc.LayerNormKernelCase(
      (1000, 8192), -1, "bfloat16", True, True, True, 0.0
    ),
  },
}

INFO = base.OpInfo(
  name="layer_norm",
  build=build,
  reference=lambda args, kwargs: references.layer_norm(*args, **kwargs),
  reduction_length=lambda s, f: s["d"],
  has_matmul=False,
  features={
    "plain": {},
    "rms": {"rms": True},
    "axis0": {"axis": 0},
    "no_scale_offset": {"no_scale": True, "no_offset": True},
    "scale_offset": {"scale_offset": 1.0, "rms": True},
    # Epsilon comparable to the variance, so where it enters the statistics matters.
    "large_epsilon": {"epsilon": 0.5},
  },
  matrices={
    base.CPU: base.Matrix(
      shapes=(dict(rows=(3, 7), d=96), dict(rows=(5,), d=257, dtypes=("float32",))),
      dtypes=("float32", "bfloat16"),
      interpret_shapes=(dict(rows=(9,), d=200),),
    ),
    base.H100: _GPU,
    base.A100: _GPU,
    base.TPU_V5: _GPU,
  },
  golden_shape=dict(rows=(64,), d=256),
  abstract_call=tuple(
    jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((16, 1024), (1024,), (1024,))
  ),
  bench={
    base.CPU: (base.BenchCall(dict(rows=(512,), d=1024), "float32", "plain"),),
    base.H100: _GPU_BENCH,
    base.A100: _GPU_BENCH,
    base.TPU_V5: _GPU_BENCH,
  },
  sizes=_sizes,
  anchors={"jnp": _plain_jnp},
  kernel_cases=_KERNEL_CASES,
)
