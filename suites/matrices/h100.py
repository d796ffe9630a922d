"""The H100/H200 matrix (sm_90): every implementation, bf16 and f32 correctness, anchor-sized benchmarks.

The benchmark shapes are the team's anchors (see `suites/results/`): attention
B4 T4096 N32 H128, layer norm 16384x4096, SwiGLU 8192x4096x14336, ragged dot
M16384 K4096 N2048 G8.
"""

MATRIX = {
  "dot_product_attention": {
    "shapes": [dict(b=2, t=384, s=512, n=8, k=2, h=128)],
    "long_shapes": [
      dict(b=1, t=2048, s=2048, n=8, k=8, h=128),
      dict(b=2, t=1000, s=777, n=4, k=1, h=64),
    ],
    "dtypes": ("bfloat16", "float32"),
  },
  "layer_norm": {
    "shapes": [dict(rows=(4, 512), d=1024), dict(rows=(300,), d=4097)],
    "long_shapes": [dict(rows=(8192,), d=8192)],
    "dtypes": ("bfloat16", "float32"),
  },
  "gated_linear_unit": {
    "shapes": [dict(m=512, k=1024, n=768), dict(batch=(2,), m=100, k=256, n=384)],
    "long_shapes": [dict(m=4096, k=4096, n=4096)],
    "dtypes": ("bfloat16", "float32"),
  },
  "ragged_dot": {
    "shapes": [dict(m=1024, k=512, n=384, g=8), dict(m=333, k=256, n=128, g=5)],
    "long_shapes": [dict(m=8192, k=2048, n=1024, g=16)],
    "dtypes": ("bfloat16", "float32"),
  },
  "linear_softmax_cross_entropy_loss": {
    "shapes": [dict(b=512, h=256, v=50257)],
    "long_shapes": [dict(b=4096, h=2048, v=65536)],
    "dtypes": ("bfloat16", "float32"),
  },
}

BENCH = [
  dict(
    op="dot_product_attention",
    shape=dict(b=4, t=4096, s=4096, n=32, k=32, h=128),
    dtype="bfloat16",
    feature="plain",
  ),
  dict(
    op="dot_product_attention",
    shape=dict(b=4, t=4096, s=4096, n=32, k=32, h=128),
    dtype="bfloat16",
    feature="causal",
  ),
  dict(op="layer_norm", shape=dict(rows=(16384,), d=4096), dtype="bfloat16", feature="plain"),
  dict(
    op="gated_linear_unit",
    shape=dict(m=8192, k=4096, n=14336),
    dtype="bfloat16",
    feature="swiglu",
    modes=("fwd",),
  ),
  dict(
    op="ragged_dot", shape=dict(m=16384, k=4096, n=2048, g=8), dtype="bfloat16", feature="default"
  ),
  dict(
    op="linear_softmax_cross_entropy_loss",
    shape=dict(b=4096, h=2048, v=65536),
    dtype="bfloat16",
    feature="sum",
  ),
]
