"""layer_norm (LayerNorm and RMSNorm) in the op database."""

import jax.numpy as jnp
from hypothesis import strategies as st

from harness import references
from suites.opdb import base


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
  bench={
    base.CPU: (base.BenchCall(dict(rows=(512,), d=1024), "float32", "plain"),),
    base.H100: _GPU_BENCH,
    base.A100: _GPU_BENCH,
    base.TPU_V5: _GPU_BENCH,
  },
  sizes=_sizes,
)
