"""How to build inputs, references and feature variants for each op.

One builder per op, keyed by the op's `SPEC.name`. The hardware matrices
(`cpu`, `h100`, ...) name shapes, dtypes and features; a builder turns one
(shape, dtype, features) into arguments of the op's public signature (as
`SPEC.canonicalize` takes them) and into the matching call of the independent
reference in `harness.references`. Inputs are random and scaled so that
outputs are O(1), which the tolerance policy assumes.
"""

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from harness import references

SPEC_MODULES = {
  "dot_product_attention": "tokamax._src.ops.attention.spec",
  "layer_norm": "tokamax._src.ops.normalization.spec",
  "gated_linear_unit": "tokamax._src.ops.gated_linear_unit.spec",
  "ragged_dot": "tokamax._src.ops.ragged_dot.spec",
  "linear_softmax_cross_entropy_loss": "tokamax._src.ops.linear_softmax_cross_entropy_loss.spec",
}

ACTIVATIONS: dict[str, Callable | None] = {
  "none": None,
  "silu": jax.nn.silu,
  "gelu": jax.nn.gelu,
  "relu": jax.nn.relu,
}


def spec_of(op: str):
  """The op's declaration (`SPEC`)."""
  return importlib.import_module(SPEC_MODULES[op]).SPEC


class _Draw:
  """Random inputs from one key, drawn on the host (no compilation per shape)."""

  def __init__(self, key: jax.Array):
    seed = np.asarray(jax.random.key_data(key)).astype(np.uint64).tolist()
    self.rng = np.random.default_rng(seed)

  def normal(self, shape, dtype, scale=1.0):
    x = (scale * self.rng.standard_normal(shape)).astype(np.float32)
    return jnp.asarray(x.astype(jnp.dtype(dtype)))

  def bools(self, shape, p=0.8):
    return jnp.asarray(self.rng.random(shape) < p)

  def ints(self, shape, low, high):
    return jnp.asarray(self.rng.integers(low, high, shape).astype(np.int32))

  def seed(self) -> int:
    return int(self.rng.integers(0, 2**31 - 1))


@dataclasses.dataclass(frozen=True)
class Built:
  """One call: public args and kwargs; `diff` names the differentiable positional args."""

  args: tuple
  kwargs: dict
  diff: tuple[int, ...]
  names: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Builder:
  """What the suites need to know to test one op.

  Attributes:
    build: (draw, shape, dtype, features) -> Built.
    reference: (args, kwargs) -> the reference's value (run it through
      `references.high_precision` for the high-precision result).
    reduction_length: (shape, features) -> length of the longest reduction.
    has_matmul: Whether the op is matmul-based.
    features: The feature variants every matrix draws from (name -> kwargs).
  """

  build: Callable[..., Built]
  reference: Callable[[tuple, dict], Any]
  reduction_length: Callable[[dict, dict], int]
  has_matmul: bool
  features: dict[str, dict]


# --- attention -----------------------------------------------------------------


def _attention_build(d: _Draw, shape, dtype, f) -> Built:
  b, t, s, n, k, h = (shape[x] for x in ["b", "t", "s", "n", "k", "h"])
  hv = shape.get("hv", h)
  q = d.normal((b, t, n, h), dtype)
  key = d.normal((b, s, k, h), dtype)
  v = d.normal((b, s, k, hv), dtype)
  bias = mask = None
  if f.get("bias"):
    bshape = {"full": (b, n, t, s), "heads": (1, n, 1, s), "batch": (b, 1, t, s)}[f["bias"]]
    bias = d.normal(bshape, dtype)
  if f.get("mask"):
    mshape = {"full": (b, n, t, s), "keys": (b, 1, 1, s), "rows": (1, 1, t, s)}[f["mask"]]
    mask = d.bools(mshape)
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
  return Built(args, kwargs, diff, ("query", "key", "value", "bias", "mask"))


def _attention_reference(args, kwargs):
  return references.attention(*args, **{k: v for k, v in kwargs.items() if k != "precision"})


ATTENTION = Builder(
  build=_attention_build,
  reference=_attention_reference,
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
  },
)


# --- layer norm ----------------------------------------------------------------


def _norm_build(d: _Draw, shape, dtype, f) -> Built:
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
  return Built((x, scale, offset), kwargs, diff, ("x", "scale", "offset"))


LAYER_NORM = Builder(
  build=_norm_build,
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
)


# --- gated linear unit ---------------------------------------------------------


def _glu_build(d: _Draw, shape, dtype, f) -> Built:
  m, k, n = shape["m"], shape["k"], shape["n"]
  x = d.normal((*shape.get("batch", ()), m, k), dtype)
  if f.get("split_weights"):
    weights = (d.normal((k, n), dtype, k**-0.5), d.normal((k, n), dtype, k**-0.5))
  else:
    weights = d.normal((k, 2, n), dtype, k**-0.5)
  kwargs = {"activation": ACTIVATIONS[f.get("activation", "silu")]}
  return Built((x, weights), kwargs, (0, 1), ("x", "weights"))


GATED_LINEAR_UNIT = Builder(
  build=_glu_build,
  reference=lambda args, kwargs: references.gated_linear_unit(
    *args, activation=kwargs["activation"]
  ),
  reduction_length=lambda s, f: s["k"],
  has_matmul=True,
  features={
    "swiglu": {"activation": "silu"},
    "geglu": {"activation": "gelu"},
    "bilinear": {"activation": "none"},
    "split_weights": {"activation": "silu", "split_weights": True},
  },
)


# --- ragged dot ----------------------------------------------------------------


def _group_sizes(d: _Draw, m: int, g: int, f) -> np.ndarray:
  from tokamax._src.ops.ragged_dot import spec

  used = m - max(1, m // 8) if f.get("unused_rows") else m
  empty = 0.25 if f.get("empty_groups") else 0.0
  return spec.generate_ragged_dot_group_sizes(used, g, seed=d.seed(), empty_fraction=empty)


def _ragged_build(d: _Draw, shape, dtype, f) -> Built:
  from tokamax._src.ops.ragged_dot import spec

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
  return Built((lhs, rhs, sizes), kwargs, (0, 1), ("lhs", "rhs", "group_sizes"))


def _ragged_reference(args, kwargs):
  from tokamax._src.ops.ragged_dot import spec

  lhs, rhs, sizes = args
  layout = spec.layout_of(kwargs["ragged_dot_dimension_numbers"])
  return references.ragged_dot_general(
    lhs, rhs, sizes, layout, kwargs.get("group_offset"), kwargs.get("num_local_groups")
  )


RAGGED_DOT = Builder(
  build=_ragged_build,
  reference=_ragged_reference,
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
  },
)


# --- loss ----------------------------------------------------------------------


def _loss_build(d: _Draw, shape, dtype, f) -> Built:
  b, h, v = shape["b"], shape["h"], shape["v"]
  x = d.normal((b, h), dtype)
  w = d.normal((h, v), dtype, h**-0.5)
  labels = d.ints((b,), 0, v)
  return Built(
    (x, labels, w), {"reduction": f.get("reduction", "sum")}, (0, 2), ("x", "labels", "weights")
  )


LOSS = Builder(
  build=_loss_build,
  reference=lambda args, kwargs: references.linear_softmax_cross_entropy_loss(*args, **kwargs),
  reduction_length=lambda s, f: s["h"],
  has_matmul=True,
  features={
    "sum": {"reduction": "sum"},
    "mean": {"reduction": "mean"},
    "none": {"reduction": "none"},
  },
)


BUILDERS: dict[str, Builder] = {
  "dot_product_attention": ATTENTION,
  "layer_norm": LAYER_NORM,
  "gated_linear_unit": GATED_LINEAR_UNIT,
  "ragged_dot": RAGGED_DOT,
  "linear_softmax_cross_entropy_loss": LOSS,
}

OPS = tuple(BUILDERS)
