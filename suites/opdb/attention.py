"""dot_product_attention in the op database."""

import jax
from hypothesis import strategies as st

from harness import references
from suites.opdb import base

_BIAS_SHAPES = {"full": "bnts", "heads": "1n1s", "batch": "b1ts"}
_MASK_SHAPES = {"full": "bnts", "keys": "b11s", "rows": "11ts", "empty_rows": "b1ts"}


def _plane(layout: str, dims: dict) -> tuple[int, ...]:
  return tuple(1 if c == "1" else dims[c] for c in layout)


def build(d: base.Draw, shape: dict, dtype: str, f: dict) -> base.Built:
  b, t, s, n, k, h = (shape[x] for x in "btsnkh")
  hv = shape.get("hv", h)
  dims = dict(b=b, n=n, t=t, s=s)
  # `magnitude` scales the logits (q.k has unit variance at magnitude 1).
  q = d.normal((b, t, n, h), dtype, f.get("magnitude", 1.0))
  key = d.normal((b, s, k, h), dtype)
  v = d.normal((b, s, k, hv), dtype)
  bias = mask = None
  if f.get("bias"):
    bias = d.normal(_plane(_BIAS_SHAPES[f["bias"]], dims), dtype)
  if f.get("mask"):
    mask = d.bools(_plane(_MASK_SHAPES[f["mask"]], dims))
    if f["mask"] == "empty_rows":  # Rows that see no key at all: first, middle and last.
      mask = mask.at[:, :, jax.numpy.asarray([0, t // 2, t - 1]), :].set(False)
  kwargs = {
    "is_causal": bool(f.get("is_causal", False)),
    "scale": f.get("scale"),
    "local_window_size": f.get("local_window_size"),
    "logits_soft_cap": f.get("logits_soft_cap"),
  }
  if f.get("kv_seq_lengths"):
    kwargs["key_value_seq_lengths"] = d.ints((b,), max(1, s // 2), s + 1)
  if f.get("q_seq_lengths"):
    kwargs["query_seq_lengths"] = d.ints((b,), max(1, t // 2), t + 1)
  args = (q, key, v, bias, mask)
  diff = (0, 1, 2) + ((3,) if bias is not None else ())
  return base.Built(args, kwargs, diff, ("query", "key", "value", "bias", "mask"))


def reference(args: tuple, kwargs: dict):
  return references.attention(*args, **{k: v for k, v in kwargs.items() if k != "precision"})


def _jax_nn(args: tuple, kwargs: dict):
  q, k, v, bias, mask = args
  return jax.nn.dot_product_attention(
    q, k, v, bias, mask, scale=kwargs.get("scale"), is_causal=kwargs.get("is_causal", False)
  )


def _sizes():
  heads = st.sampled_from([(1, 1), (2, 1), (4, 2), (2, 2)])
  dims = st.fixed_dictionaries(
    dict(
      b=st.integers(1, 2),
      t=st.integers(1, 40),
      s=st.integers(1, 40),
      h=st.sampled_from([8, 16, 32]),
    )
  )
  return dims.flatmap(lambda d: heads.map(lambda nk: {**d, "n": nk[0], "k": nk[1]}))


_GPU = base.Matrix(
  shapes=(dict(b=2, t=384, s=512, n=8, k=2, h=128),),
  dtypes=("bfloat16", "float32"),
  long_shapes=(
    dict(b=1, t=2048, s=2048, n=8, k=8, h=128),
    dict(b=2, t=1000, s=777, n=4, k=1, h=64),
  ),
)
_ANCHOR_SHAPE = dict(b=4, t=4096, s=4096, n=32, k=32, h=128)
_GPU_BENCH = (
  base.BenchCall(_ANCHOR_SHAPE, "bfloat16", "plain"),
  base.BenchCall(_ANCHOR_SHAPE, "bfloat16", "causal"),
)

INFO = base.OpInfo(
  name="dot_product_attention",
  build=build,
  reference=reference,
  reduction_length=lambda s, f: max(s["h"], s["s"]),
  has_matmul=True,
  features={
    "plain": {},
    "causal": {"is_causal": True},
    "bias": {"bias": "full"},
    "bias_bcast": {"bias": "heads"},
    "mask": {"mask": "full"},
    "mask_bcast": {"mask": "keys"},
    "window": {"local_window_size": (7, 3)},
    "causal_window": {"is_causal": True, "local_window_size": 5},
    "soft_cap": {"logits_soft_cap": 2.0},
    "kv_lengths": {"kv_seq_lengths": True},
    "q_lengths": {"q_seq_lengths": True, "is_causal": True},
    "scale": {"scale": 0.3},
    # Gradients cancel terms 100x their size (dk sums dS * q): see checks._gradient_reduction_length.
    "large_logits": {"magnitude": 100.0, "grad_conditioning": 100.0},
    "empty_rows": {"mask": "empty_rows"},
  },
  matrices={
    base.CPU: base.Matrix(
      shapes=(
        dict(b=2, t=40, s=56, n=4, k=2, h=32),
        dict(b=1, t=33, s=33, n=3, k=1, h=16, hv=24, dtypes=("float32",)),
      ),
      dtypes=("float32", "bfloat16"),
      interpret_shapes=(dict(b=1, t=40, s=72, n=2, k=1, h=32),),
    ),
    base.H100: _GPU,
    base.A100: _GPU,
    base.TPU_V5: _GPU,
  },
  golden_shape=dict(b=1, t=128, s=128, n=2, k=1, h=64),
  bench={
    base.CPU: (base.BenchCall(dict(b=1, t=256, s=256, n=4, k=4, h=64), "float32", "causal"),),
    base.H100: _GPU_BENCH,
    base.A100: _GPU_BENCH,
    base.TPU_V5: _GPU_BENCH,
  },
  sizes=_sizes,
  # Key chunks of 16: the matrix's S=56 and S=33 end in a partial chunk (8 and 1 keys).
  config_variants={"xla_chunked": {"kv16": {"kv_chunk_size": 16}}},
  anchors={"jax.nn": _jax_nn},
)
