"""linear_softmax_cross_entropy_loss in the op database."""

import jax
import jax.numpy as jnp
from hypothesis import strategies as st

from suites.opdb import base
from tokamax_harness import references


def build(d: base.Draw, shape: dict, dtype: str, f: dict) -> base.Built:
  b, h, v = shape["b"], shape["h"], shape["v"]
  # `magnitude` scales the logits (unit variance at magnitude 1).
  x = d.normal((b, h), dtype, f.get("magnitude", 1.0))
  w = d.normal((h, v), dtype, h**-0.5)
  labels = d.ints((b,), 0, v)
  kwargs = {"reduction": f.get("reduction", "sum")}
  if f.get("full_precision"):
    kwargs["precision"] = jax.lax.Precision.HIGHEST
  return base.Built((x, labels, w), kwargs, (0, 2), ("x", "labels", "weights"))


def reference(args: tuple, kwargs: dict):
  return references.linear_softmax_cross_entropy_loss(*args, reduction=kwargs["reduction"])


def _plain_jnp(args: tuple, kwargs: dict):
  """The loss as a user writes it in jnp (float32 logits, log_softmax): #24's yardstick."""
  x, labels, w = args
  logits = jnp.matmul(x, w, preferred_element_type=jnp.float32)
  per_row = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=-1)[:, 0]
  return {"sum": per_row.sum, "mean": per_row.mean}.get(kwargs["reduction"], lambda: per_row)()


def _sizes():
  return st.fixed_dictionaries(
    dict(b=st.integers(1, 24), h=st.integers(1, 48), v=st.integers(2, 700))
  )


# mosaic@grad_in_forward serves V=50257 with the recomputing backward; its own pass is
# checked compiled in suites/kernels/test_gpu_compiled.py.
_GPU = base.Matrix(
  shapes=(dict(b=512, h=256, v=50257),),
  dtypes=("bfloat16", "float32"),
  long_shapes=(dict(b=4096, h=2048, v=65536),),
)
# TPU v5: the GPU shapes; the interpret shape runs the Mosaic TPU kernel in the TPU
# interpreter (TOKAMAX_FAMILY=tpu_v5 on a CPU host) with its heuristic blocks: one row tile
# (partial at bfloat16: 48 rows), one 512-column vocabulary tile and a 188-column tail in XLA,
# forward and backward.
# suites/kernels/test_tpu_loss.py covers several row and vocabulary tiles and K steps.
# H is small for "large_logits" (logits in the thousands): from H=64 in float32 some dweights
# exceed that case's bound, for chunked_xla too (both backward passes recompute the logits):
# the probabilities exp(logit - lse) carry the float32 rounding of such logits (~1e-3).
_TPU = base.Matrix(
  shapes=_GPU.shapes,
  dtypes=("bfloat16", "float32"),
  interpret_shapes=(dict(b=40, h=32, v=700),),
  interpret_dtypes=("float32", "bfloat16"),
  long_shapes=_GPU.long_shapes,
)
# The last two are the fused kernel's target shapes (large vocabularies).
_GPU_BENCH = (
  base.BenchCall(dict(b=4096, h=2048, v=65536), "bfloat16", "sum"),
  base.BenchCall(dict(b=8192, h=4096, v=131072), "bfloat16", "sum"),
  base.BenchCall(dict(b=4096, h=4096, v=256000), "bfloat16", "sum"),
)

INFO = base.OpInfo(
  name="linear_softmax_cross_entropy_loss",
  build=build,
  reference=reference,
  reduction_length=lambda s, f: base.conditioned(s["h"], f),
  has_matmul=True,
  features={
    "sum": {"reduction": "sum"},
    "mean": {"reduction": "mean"},
    "none": {"reduction": "none"},
    # Logits in the thousands, at full matmul precision (TF32 rounding would move them by
    # ~1); dweights cancels terms that large, so `conditioning` widens the bound as a
    # c**2-times longer reduction would.
    "large_logits": {
      "reduction": "none",
      "magnitude": 1000.0,
      "full_precision": True,
      "conditioning": 30.0,
    },
  },
  matrices={
    base.CPU: base.Matrix(
      shapes=(dict(b=24, h=32, v=1003), dict(b=7, h=48, v=130, dtypes=("float32",))),
      dtypes=("float32", "bfloat16"),
      # The last two suit the Mosaic kernel (H a multiple of 64). V=300 is one vocabulary
      # tile and a 44-column tail; 40 rows are a partial row tile. The second takes mosaic@grad_in_forward's pass over row chunks (V % 64 == 0): two
      # chunks of 128 rows, the second partial, and a 64-column tail past two tiles; it comes
      # first of the Mosaic kernel's shapes, whose gradients the matrix checks.
      interpret_shapes=(
        dict(b=24, h=32, v=300),
        dict(b=200, h=128, v=576, dtypes=("bfloat16",)),
        dict(b=40, h=128, v=300, dtypes=("bfloat16",)),
      ),
    ),
    base.H100: _GPU,
    base.A100: _GPU,
    base.TPU_V5: _TPU,
  },
  golden_shape=dict(b=128, h=128, v=512),
  abstract_call=(
    jax.ShapeDtypeStruct((128, 256), jnp.bfloat16),
    jax.ShapeDtypeStruct((128,), jnp.int32),
    jax.ShapeDtypeStruct((256, 1024), jnp.bfloat16),
  ),
  bench={
    base.CPU: (base.BenchCall(dict(b=256, h=256, v=8192), "float32", "sum"),),
    base.H100: _GPU_BENCH,
    base.A100: _GPU_BENCH,
    base.TPU_V5: _GPU_BENCH,
  },
  sizes=_sizes,
  anchors={"jnp": _plain_jnp},
  # Vocabulary chunks of 128: V=1003 and V=130 end in a partial chunk (107 and 2 columns).
  config_variants={
    "chunked_xla": {"v128": {"vocab_chunk_size": 128}},
    "mosaic": {"grad_in_forward": {"gradient_in_forward": True, "row_chunks": 4, "num_stages": 2}},
  },
)
