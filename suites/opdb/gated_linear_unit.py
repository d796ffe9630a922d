"""gated_linear_unit in the op database."""

import jax
import jax.numpy as jnp
from hypothesis import strategies as st

from suites.opdb import base
from suites.opdb import kernel_cases as kc
from tokamax_harness import references

# Every activation an implementation accepts by name is a feature, so each kernel is checked
# with each.
ACTIVATIONS = {
  "none": None,
  "silu": jax.nn.silu,
  "gelu": jax.nn.gelu,
  "relu": jax.nn.relu,
  "leaky_relu": jax.nn.leaky_relu,
  "sigmoid": jax.nn.sigmoid,
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
  if f.get("full_precision"):
    kwargs["precision"] = jax.lax.Precision.HIGHEST
  return base.Built((x, weights), kwargs, (0, 1), ("x", "weights"))


def reference(args: tuple, kwargs: dict):
  return references.gated_linear_unit(*args, activation=kwargs["activation"])


def _plain_jnp(args: tuple, kwargs: dict):
  """A GLU as a user writes it in jnp (one einsum over fused weights): #24's yardstick."""
  x, weights = args
  if isinstance(weights, tuple):
    gate, up = (jnp.einsum("...k,kn->...n", x, w) for w in weights)
  else:
    both = jnp.einsum("...k,kjn->...jn", x, weights)
    gate, up = both[..., 0, :], both[..., 1, :]
  activation = kwargs["activation"]
  return (gate if activation is None else activation(gate)) * up


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
  # A custom_jvp activation (jax.nn.relu) in the Mosaic epilogue.
  base.BenchCall(dict(m=8192, k=4096, n=14336), "bfloat16", "reglu", modes=(base.FWD,)),
)

_MOSAIC_SMALL = dict(block_n=64, num_stages=2, epi_n=64, grid_tile_m=2)

# Kernel cases (`kernel_cases`). Triton's run in its interpreter on CPU and compiled on a
# GPU (the "triton:gpu" ones on a GPU only, at each of the test's dtypes).
_KERNEL_CASES = {
  "triton": {
    "f32_batch_swish_fused": kc.GluKernelCase(
      (2, 37, 40), n=72, dtype="float32", activation=jax.nn.swish, fused=True
    ),
    "f16_gelu_pair": kc.GluKernelCase(
      (50, 64), n=48, dtype="float16", activation=jax.nn.gelu, fused=False
    ),
    "f32_linear_fused": kc.GluKernelCase((20, 30), n=20, dtype="float32", fused=True),
    "f32_sigmoid_pair": kc.GluKernelCase(
      (33, 48), n=40, dtype="float32", activation=jax.nn.sigmoid, fused=False
    ),
  },
  "triton:gpu": {
    "batch_swish_fused_n384": kc.GluKernelCase(
      (4, 200, 256), n=384, activation=jax.nn.swish, fused=True
    ),
  },
  # Compiled on a GPU through the public API against XLA (suites/kernels/test_gpu_compiled.py).
  "triton:gpu_compiled": {
    "bf16_batch_swish_fused": kc.GluKernelCase(
      (4, 200, 256), n=384, dtype="bfloat16", activation=jax.nn.swish, fused=True
    ),
    "bf16_gelu_pair": kc.GluKernelCase(
      (300, 512), n=200, dtype="bfloat16", activation=jax.nn.gelu, fused=False
    ),
    "f32_linear_fused": kc.GluKernelCase((64, 96), n=128, dtype="float32", fused=True),
  },
  # Mosaic GPU's compiled on a Hopper GPU against float64 (swish, bfloat16;
  # suites/kernels/test_gpu_compiled.py).
  "mosaic:gpu_compiled": {
    "bwd_mosaic": kc.GluKernelCase(
      (1000, 256), n=384, dtype="bfloat16", activation=jax.nn.swish, backward="mosaic"
    ),
    "bwd_xla": kc.GluKernelCase(
      (264, 512), n=512, dtype="bfloat16", activation=jax.nn.swish, backward="xla"
    ),
    "pair_bwd_default": kc.GluKernelCase(
      (264, 512), n=512, dtype="bfloat16", activation=jax.nn.swish, fused=False
    ),
    # A custom-JVP activation, inlined into the epilogue.
    "relu_bwd_mosaic": kc.GluKernelCase(
      (264, 512), n=512, dtype="bfloat16", activation=jax.nn.relu, backward="mosaic"
    ),
  },
  # Mosaic GPU's, in the Pallas interpreter (N = 128, bfloat16); "small" is the
  # test's small-block config fields.
  "mosaic": {
    # Batch dims; 100 rows: padded to 104. Backward matmuls in the ragged_dot kernels.
    "batch_swish_bwd_mosaic": kc.GluKernelCase(
      (2, 50, 128), activation=jax.nn.swish, fused=True, backward="mosaic", config=_MOSAIC_SMALL
    ),
    "linear_pair": kc.GluKernelCase((64, 128), fused=False, config=_MOSAIC_SMALL),
    # custom_jvp activations (relu, relu6) are inlined into the epilogue.
    "relu_bwd_mosaic": kc.GluKernelCase(
      (64, 128), activation=jax.nn.relu, fused=True, backward="mosaic", config=_MOSAIC_SMALL
    ),
    "gelu_bwd_xla": kc.GluKernelCase(
      (72, 128), activation=jax.nn.gelu, fused=True, backward="xla", config=_MOSAIC_SMALL
    ),
    # Two row tiles, the second 8 rows.
    "linear_two_row_tiles_bwd_mosaic_xla": kc.GluKernelCase(
      (136, 128), fused=True, backward=("mosaic", "xla"), config=_MOSAIC_SMALL
    ),
    "swish_bwd_xla_mosaic": kc.GluKernelCase(
      (64, 128),
      activation=jax.nn.swish,
      fused=True,
      backward=("xla", "mosaic"),
      config=_MOSAIC_SMALL,
    ),
    # Two-CTA clusters sharing x tiles by multicast.
    "swish_cluster2_bwd_xla": kc.GluKernelCase(
      (136, 256),
      activation=jax.nn.swish,
      fused=True,
      backward="xla",
      config=dict(_MOSAIC_SMALL, cluster=2),
    ),
    # The heuristic config of a single row tile; the second warpgroup has no rows.
    "swish_heuristic_one_row_tile": kc.GluKernelCase(
      (40, 384), activation=jax.nn.swish, fused=True
    ),
  },
}

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
    # Kinked activations: a float32 gate rounded at TF32 lands on the other side of the kink
    # for ~0.1% of elements (H200), so these run their matmuls at full precision.
    "reglu": {"activation": "relu", "full_precision": True},
    "leaky_reglu": {"activation": "leaky_relu", "full_precision": True},
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
  abstract_call=tuple(jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((256, 512), (512, 2, 512))),
  bench={
    base.CPU: (base.BenchCall(dict(m=256, k=512, n=1024), "float32", "swiglu"),),
    base.H100: _GPU_BENCH,
    base.A100: _GPU_BENCH,
    base.TPU_V5: _GPU_BENCH,
  },
  sizes=_sizes,
  anchors={"jnp": _plain_jnp},
  kernel_cases=_KERNEL_CASES,
)
