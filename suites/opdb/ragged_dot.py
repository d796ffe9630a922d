"""ragged_dot (and ragged_dot_general's layouts) in the op database."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from suites.opdb import base
from suites.opdb import kernel_cases as kc
from tokamax._src.ops.ragged_dot import spec
from tokamax_harness import references


def _group_sizes(d: base.Draw, m: int, g: int, f: dict) -> np.ndarray:
  used = m - max(1, m // 8) if f.get("unused_rows") else m
  if f.get("equal_groups"):  # The remainder goes to the last group.
    sizes = np.full(g, used // g, np.int32)
    sizes[-1] += used - sizes.sum()
    return sizes
  empty = 0.25 if f.get("empty_groups") else 0.0
  alpha = f.get("alpha", 1.0)
  return spec.generate_ragged_dot_group_sizes(
    used, g, seed=d.seed(), alpha=alpha, empty_fraction=empty
  )


def build(d: base.Draw, shape: dict, dtype: str, f: dict) -> base.Built:
  m, k, n, g = shape["m"], shape["k"], shape["n"], shape["g"]
  layout = f.get("layout", spec.DEFAULT)
  sizes = jnp.asarray(_group_sizes(d, m, g, f))
  local = g - 2 if f.get("group_offset") else g
  lhs = d.normal((m, k), dtype)
  if layout == spec.RAGGED_CONTRACTING:
    rows = max(1, m // g)
    lhs = d.normal((m, k), dtype, rows**-0.25)
    rhs = d.normal((m, n), dtype, rows**-0.25)
  elif layout == spec.RHS_TRANSPOSED:
    rhs = d.normal((local, n, k), dtype, k**-0.5)
  else:
    rhs = d.normal((local, k, n), dtype, k**-0.5)
  kwargs = {"ragged_dot_dimension_numbers": spec.dimension_numbers(layout)}
  if f.get("group_offset"):
    kwargs["group_offset"] = jnp.asarray([1], jnp.int32)
    if layout == spec.RAGGED_CONTRACTING:
      kwargs["num_local_groups"] = local
  return base.Built((lhs, rhs, sizes), kwargs, (0, 1), ("lhs", "rhs", "group_sizes"))


def reference(args: tuple, kwargs: dict):
  lhs, rhs, sizes = args
  layout = spec.layout_of(kwargs["ragged_dot_dimension_numbers"])
  return references.ragged_dot_general(
    lhs, rhs, sizes, layout, kwargs.get("group_offset"), kwargs.get("num_local_groups")
  )


def _jax_lax(args: tuple, kwargs: dict):
  lhs, rhs, sizes = args
  return jax.lax.ragged_dot_general(lhs, rhs, sizes, kwargs["ragged_dot_dimension_numbers"])


def _sizes():
  return st.fixed_dictionaries(
    dict(m=st.integers(8, 80), k=st.integers(1, 48), n=st.integers(1, 48), g=st.integers(3, 6))
  )


_GPU = base.Matrix(
  shapes=(dict(m=1024, k=512, n=384, g=8), dict(m=333, k=256, n=128, g=5)),
  dtypes=("bfloat16", "float32"),
  long_shapes=(dict(m=8192, k=2048, n=1024, g=16),),
)
# The cases of docs/perf.md.
_GPU_BENCH = (
  base.BenchCall(dict(m=16384, k=4096, n=2048, g=8), "bfloat16", "equal_groups"),
  base.BenchCall(dict(m=32768, k=7168, n=2048, g=64), "bfloat16", "equal_groups"),
  base.BenchCall(dict(m=32768, k=7168, n=2048, g=64), "bfloat16", "skewed"),
  # The G64 step's weight gradient on its own: ragged_dot_general contracting over the
  # ragged rows (lhs [M, K], dout [M, N] -> [G, K, N]), the Mosaic drhs kernel. Forward only
  # (jax.lax has no gradient of this layout, and the equal_groups step times it as a part).
  base.BenchCall(
    dict(m=32768, k=7168, n=2048, g=64), "bfloat16", "drhs_equal_groups", modes=(base.FWD,)
  ),
)

# Kernel cases (`kernel_cases`). Triton's run in its interpreter on CPU and compiled on a
# GPU (the "triton:gpu" ones on a GPU only, at each of the test's dtypes); its
# group_offset is the first group or None.
_KERNEL_CASES = {
  "triton": {
    "default_f32": kc.RaggedDotKernelCase(spec.DEFAULT, 70, 40, 24, 5, "float32", None),
    "rhs_transposed_f16_offset": kc.RaggedDotKernelCase(
      spec.RHS_TRANSPOSED, 64, 32, 48, 4, "float16", 1
    ),
    "ragged_contracting_f32": kc.RaggedDotKernelCase(
      spec.RAGGED_CONTRACTING, 80, 24, 40, 5, "float32", None
    ),
    "default_f32_offset": kc.RaggedDotKernelCase(spec.DEFAULT, 50, 48, 32, 3, "float32", 2),
  },
  "triton:gpu": {
    "default_m1000": kc.RaggedDotKernelCase(spec.DEFAULT, 1000, 256, 384, 8, None, None),
  },
  # Mosaic GPU's, in the Pallas interpreter with race detection; group_offset: whether
  # the call starts at group 1.
  "mosaic": {
    "default": kc.RaggedDotKernelCase(spec.DEFAULT, 136, 128, 128, 3, "bfloat16", False),
    # M not a multiple of 8: padded.
    "rhs_transposed_offset": kc.RaggedDotKernelCase(
      spec.RHS_TRANSPOSED, 100, 128, 128, 3, "bfloat16", True
    ),
    "ragged_contracting_offset": kc.RaggedDotKernelCase(
      spec.RAGGED_CONTRACTING, 144, 128, 128, 3, "bfloat16", True
    ),
  },
  # Mosaic GPU's compiled on a Hopper GPU against float64 (suites/kernels/test_gpu_compiled.py).
  "mosaic:gpu_compiled": {
    "default_offset": kc.RaggedDotKernelCase(spec.DEFAULT, 1000, 512, 256, 6, "bfloat16", True),
    "rhs_transposed": kc.RaggedDotKernelCase(
      spec.RHS_TRANSPOSED, 1000, 512, 256, 9, "bfloat16", False
    ),
    "rhs_transposed_m776": kc.RaggedDotKernelCase(
      spec.RHS_TRANSPOSED, 776, 256, 512, 5, "bfloat16", False
    ),
    "ragged_contracting": kc.RaggedDotKernelCase(
      spec.RAGGED_CONTRACTING, 1000, 512, 256, 6, "bfloat16", False
    ),
  },
}

# Mosaic TPU's, in Pallas's TPU interpreter (suites/kernels/test_tpu_ragged_dot.py): odd M,
# uneven groups with empty ones and rows past the last group; group_offset: whether the call
# starts at group 1. The config (blocks) applies wherever it fits (forward and gradients);
# 128-row tiles give several row tiles, tiles shared by groups and (K=256) two K steps.
_TPU_BLOCKS = dict(block_m=128, block_k=128, block_n=128)
_KERNEL_CASES["mosaic_tpu"] = {
  "default_f32": kc.RaggedDotKernelCase(
    spec.DEFAULT, 300, 48, 40, 5, "float32", False, dict(block_m=128, block_k=48, block_n=40)
  ),
  "default_bf16_small_rows": kc.RaggedDotKernelCase(
    spec.DEFAULT, 100, 256, 256, 6, "bfloat16", True, dict(block_m=16, block_k=128, block_n=128)
  ),
  "rhs_transposed_bf16_offset": kc.RaggedDotKernelCase(
    spec.RHS_TRANSPOSED, 270, 256, 128, 4, "bfloat16", True, _TPU_BLOCKS
  ),
  "ragged_contracting_f32_offset": kc.RaggedDotKernelCase(
    spec.RAGGED_CONTRACTING, 260, 256, 136, 4, "float32", True, _TPU_BLOCKS
  ),
  "ragged_contracting_bf16": kc.RaggedDotKernelCase(
    spec.RAGGED_CONTRACTING, 150, 128, 256, 5, "bfloat16", False, _TPU_BLOCKS
  ),
  # A group of 479 rows: three row tiles inside it (used unmasked), one shared.
  "ragged_contracting_bf16_long_group": kc.RaggedDotKernelCase(
    spec.RAGGED_CONTRACTING, 600, 128, 128, 3, "bfloat16", False, _TPU_BLOCKS
  ),
}
# TPU v5: shapes the Mosaic TPU kernels take (K a multiple of 128); the interpret shapes run
# them in the TPU interpreter (TOKAMAX_FAMILY=tpu_v5 on a CPU host).
_TPU = base.Matrix(
  shapes=_GPU.shapes,
  dtypes=("bfloat16", "float32"),
  interpret_shapes=(dict(m=200, k=128, n=128, g=5),),
  interpret_dtypes=("float32", "bfloat16"),
  long_shapes=_GPU.long_shapes,
)

INFO = base.OpInfo(
  name="ragged_dot",
  build=build,
  reference=reference,
  reduction_length=lambda s, f: s["m"] if f.get("layout") == "ragged_contracting" else s["k"],
  has_matmul=True,
  features={
    "default": {"layout": "default"},
    "empty_groups": {"layout": "default", "empty_groups": True},
    "unused_rows": {"layout": "default", "unused_rows": True},
    "group_offset": {"layout": "default", "group_offset": True},
    "rhs_transposed": {"layout": "rhs_transposed", "empty_groups": True},
    "ragged_contracting": {
      "layout": "ragged_contracting",
      "empty_groups": True,
      "unused_rows": True,
    },
    "equal_groups": {"layout": "default", "equal_groups": True},
    # Router-like skew (Dirichlet concentration 0.5): a few large groups, many small ones.
    "skewed": {"layout": "default", "alpha": 0.5},
  },
  matrices={
    base.CPU: base.Matrix(
      shapes=(dict(m=96, k=48, n=40, g=5), dict(m=61, k=32, n=24, g=3, dtypes=("float32",))),
      dtypes=("float32", "bfloat16"),
      interpret_shapes=(dict(m=80, k=48, n=40, g=5),),
    ),
    base.H100: _GPU,
    base.A100: _GPU,
    base.TPU_V5: _TPU,
  },
  golden_shape=dict(m=128, k=128, n=128, g=4),
  abstract_call=(
    jax.ShapeDtypeStruct((512, 256), jnp.bfloat16),
    jax.ShapeDtypeStruct((4, 256, 256), jnp.bfloat16),
    jax.ShapeDtypeStruct((4,), jnp.int32),
  ),
  bench={
    base.CPU: (base.BenchCall(dict(m=512, k=256, n=256, g=8), "float32", "default"),),
    base.H100: _GPU_BENCH,
    base.A100: _GPU_BENCH,
    base.TPU_V5: _GPU_BENCH,
  },
  sizes=_sizes,
  anchors={"jax.lax": _jax_lax},
  kernel_cases=_KERNEL_CASES,
  bench_features={
    "drhs_equal_groups": {"layout": "ragged_contracting", "equal_groups": True},
  },
)
