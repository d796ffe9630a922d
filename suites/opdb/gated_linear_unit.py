"""gated_linear_unit in the op database."""

import jax
import jax.numpy as jnp
from hypothesis import strategies as st

from harness import references
from suites.opdb import base

# Every activation an implementation accepts by name is a feature, so each kernel is checked
# with each.
ACTIVATIONS = {
  "none": None,
  "silu": jax.nn.silu,
  "gelu": jax.nn.gelu,
  "relu": jax.nn.relu,
  "sigmoid": jax.nn.sigmoid,
  "leaky_relu": jax.nn.leaky_relu,
  "tanh": jnp.tanh,
}


def build(d: base.Draw, shape: dict, dtype: str, f: dict) -> base.Built:
  m, k, n = shape["m"], shape["k"], shape["n"]
  x = d.normal((*shape.get("batch", ()), m, k), dtype)
  if f.get("split_weights"):
    weights = (d.normal((k, n), dtype, k**-0.5), d.normal((k, n), dtype, k**-0.5))
  else:
    weights = d.normal((k, 2, n), dtype, k**-0.5)
  kwargs = {"activation": ACTIVATIONS[f.get("activation", "silu")]}
  return base.Built((x, weights), kwargs, (0, 1), ("x", "weights"))


def reference(args: tuple, kwargs: dict):
  return references.gated_linear_unit(*args, activation=kwargs["activation"])


def _sizes():
  return st.fixed_dictionaries(
    dict(m=st.integers(1, 40), k=st.integers(1, 80), n=st.integers(1, 80))
  )


_GPU = base.Matrix(
  shapes=(dict(m=512, k=1024, n=768), dict(batch=(2,), m=100, k=256, n=384)),
  dtypes=("bfloat16", "float32"),
  long_shapes=(dict(m=4096, k=4096, n=4096),),
)
# The cases of docs/perf.md.
_GPU_BENCH = (
  base.BenchCall(dict(m=8192, k=4096, n=14336), "bfloat16", "swiglu"),
  base.BenchCall(dict(m=2048, k=2048, n=8192), "bfloat16", "swiglu"),
  base.BenchCall(dict(m=128, k=4096, n=14336), "bfloat16", "swiglu"),
)

INFO = base.OpInfo(
  name="gated_linear_unit",
  build=build,
  reference=reference,
  reduction_length=lambda s, f: s["k"],
  has_matmul=True,
  features={
    "swiglu": {"activation": "silu"},
    "geglu": {"activation": "gelu"},
    "bilinear": {"activation": "none"},
    "split_weights": {"activation": "silu", "split_weights": True},
    "reglu": {"activation": "relu"},
    "sigmoid": {"activation": "sigmoid"},
    "tanh": {"activation": "tanh"},
  },
  matrices={
    base.CPU: base.Matrix(
      shapes=(dict(m=24, k=64, n=48), dict(batch=(2,), m=9, k=40, n=72, dtypes=("float32",))),
      dtypes=("float32", "bfloat16"),
      # The second is the Mosaic kernel's (bfloat16/float16, N a multiple of 64).
      interpret_shapes=(dict(m=40, k=64, n=48), dict(m=40, k=128, n=64, dtypes=("bfloat16",))),
      interpret_dtypes=("float32",),
    ),
    base.H100: _GPU,
    base.A100: _GPU,
    base.TPU_V5: _GPU,
  },
  golden_shape=dict(m=128, k=128, n=128),
  bench={
    base.CPU: (base.BenchCall(dict(m=256, k=512, n=1024), "float32", "swiglu"),),
    base.H100: _GPU_BENCH,
    base.A100: _GPU_BENCH,
    base.TPU_V5: _GPU_BENCH,
  },
  sizes=_sizes,
)
    "leaky_reglu": {"activation": "leaky_relu"},
