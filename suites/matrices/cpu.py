"""The CPU matrix: small shapes; XLA natively, kernels in interpret mode.

The second shape of each op runs in float32 only (CI time). Shapes avoid multiples of block sizes on purpose (T=33, V=1003, ...), so that
tails and padding are exercised.
"""

MATRIX = {
  "dot_product_attention": {
    "shapes": [
      dict(b=2, t=40, s=56, n=4, k=2, h=32),
      dict(b=1, t=33, s=33, n=3, k=1, h=16, hv=24, dtypes=("float32",)),
    ],
    "dtypes": ("float32", "bfloat16"),
    "interpret_shapes": [dict(b=1, t=40, s=72, n=2, k=1, h=32)],
  },
  "layer_norm": {
    "shapes": [dict(rows=(3, 7), d=96), dict(rows=(5,), d=257, dtypes=("float32",))],
    "dtypes": ("float32", "bfloat16"),
    "interpret_shapes": [dict(rows=(9,), d=200)],
  },
  "gated_linear_unit": {
    "shapes": [dict(m=24, k=64, n=48), dict(batch=(2,), m=9, k=40, n=72, dtypes=("float32",))],
    "dtypes": ("float32", "bfloat16"),
    "interpret_shapes": [dict(m=40, k=64, n=48)],
  },
  "ragged_dot": {
    "shapes": [dict(m=96, k=48, n=40, g=5), dict(m=61, k=32, n=24, g=3, dtypes=("float32",))],
    "dtypes": ("float32", "bfloat16"),
    "interpret_shapes": [dict(m=80, k=48, n=40, g=5)],
  },
  "linear_softmax_cross_entropy_loss": {
    "shapes": [dict(b=24, h=32, v=1003), dict(b=7, h=48, v=130, dtypes=("float32",))],
    "dtypes": ("float32", "bfloat16"),
    "interpret_shapes": [dict(b=24, h=32, v=300)],
  },
}

# Wallclock benchmarks (a smoke test of the benchmark path on CPU).
BENCH = [
  dict(
    op="dot_product_attention",
    shape=dict(b=1, t=256, s=256, n=4, k=4, h=64),
    dtype="float32",
    feature="causal",
  ),
  dict(op="layer_norm", shape=dict(rows=(512,), d=1024), dtype="float32", feature="plain"),
  dict(op="gated_linear_unit", shape=dict(m=256, k=512, n=1024), dtype="float32", feature="swiglu"),
  dict(op="ragged_dot", shape=dict(m=512, k=256, n=256, g=8), dtype="float32", feature="default"),
  dict(
    op="linear_softmax_cross_entropy_loss",
    shape=dict(b=256, h=256, v=8192),
    dtype="float32",
    feature="sum",
  ),
]
