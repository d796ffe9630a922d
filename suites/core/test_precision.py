"""`precision` reaches every matmul of the XLA paths, forward and backward."""

import jax
import jax.numpy as jnp
import pytest

import tokamax
from tokamax._src import jaxprs
from tokamax._src.ops.attention import mosaic_tpu as attention_tpu
from tokamax._src.ops.linear_softmax_cross_entropy_loss import mosaic_tpu as loss_tpu
from tokamax._src.ops.ragged_dot import mosaic_tpu as ragged_tpu
from tokamax._src.ops.ragged_dot import spec as ragged_spec

HIGHEST = jax.lax.Precision.HIGHEST
f32 = jnp.float32


def _precisions(fn, *args) -> list:
  """The precision of every dot_general in the jaxpr of `fn(*args)`, nested ones included."""
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  return [
    e.params["precision"]
    for e in jaxprs.equations(jaxpr)
    if e.primitive.name in ("dot_general", "ragged_dot_general")
  ]


def _attention(impl, precision):
  q = jnp.ones((2, 8, 4, 16), f32)
  kv = jnp.ones((2, 8, 2, 16), f32)
  bias = jnp.zeros((2, 4, 8, 8), f32)

  def f(q, k, v, bias):
    return tokamax.dot_product_attention(
      q, k, v, bias, precision=precision, implementation=impl
    ).sum()

  return f, (q, kv, kv, bias)


def _loss(impl, precision):
  labels = jnp.array([0, 3, 49, 7], jnp.int32)

  def f(x, w):
    return tokamax.linear_softmax_cross_entropy_loss(
      x, labels, w, precision=precision, implementation=impl
    )

  return f, (jnp.ones((4, 16), f32), jnp.ones((16, 50), f32))


def _glu(impl, precision, split=False):
  w = jnp.ones((16, 2, 8), f32)
  weights = (w[:, 0], w[:, 1]) if split else w

  def f(x, weights):
    return tokamax.gated_linear_unit(
      x, weights, activation=jax.nn.silu, precision=precision, implementation=impl
    ).sum()

  return f, (jnp.ones((2, 4, 16), f32), weights)


def _ragged(impl, precision, layout="default"):
  sizes = jnp.array([3, 0, 5], jnp.int32)
  lhs = jnp.ones((8, 16), f32)
  rhs = {
    "default": jnp.ones((3, 16, 4), f32),
    "rhs_transposed": jnp.ones((3, 4, 16), f32),
    "ragged_contracting": jnp.ones((8, 4), f32),
  }[layout]

  def f(lhs, rhs):
    return tokamax.ragged_dot_general(
      lhs,
      rhs,
      sizes,
      ragged_spec.dimension_numbers(layout),
      precision=precision,
      implementation=impl,
    ).sum()

  return f, (lhs, rhs)


def _ragged_default_layout(impl, precision):
  """The public `ragged_dot` (the default layout without dimension numbers)."""
  sizes = jnp.array([3, 0, 5], jnp.int32)

  def f(lhs, rhs):
    return tokamax.ragged_dot(lhs, rhs, sizes, precision=precision, implementation=impl).sum()

  return f, (jnp.ones((8, 16), f32), jnp.ones((3, 16, 4), f32))


def _tpu_attention(precision):
  """The Mosaic TPU kernels (interpreted; only traced here) at shapes they take: head dim 64,
  keys a multiple of 128; the bias's gradient from XLA."""
  q = jnp.ones((1, 16, 2, 64), f32)
  kv = jnp.ones((1, 128, 1, 64), f32)
  bias = jnp.zeros((1, 2, 16, 128), f32)
  impl = attention_tpu.MosaicTpuAttention(interpret=True)

  def f(q, k, v, bias):
    return tokamax.dot_product_attention(
      q, k, v, bias, precision=precision, implementation=impl
    ).sum()

  return f, (q, kv, kv, bias)


def _tpu_loss(precision):
  """The Mosaic TPU loss kernels and their XLA tail (V=300: two tiles of 128 and 44 columns)."""
  labels = jnp.array([0, 3, 299, 7, 130, 260, 1, 2], jnp.int32)
  config = loss_tpu.MosaicTpuLossConfig(
    block_b=8, block_v=128, block_k=128, bwd_block_b=8, bwd_block_v=128
  )
  impl = loss_tpu.MosaicTpuLoss(interpret=True, config=config)

  def f(x, w):
    return tokamax.linear_softmax_cross_entropy_loss(
      x, labels, w, precision=precision, implementation=impl
    )

  return f, (jnp.ones((8, 256), f32), jnp.ones((256, 300), f32))


def _tpu_ragged(precision):
  """The Mosaic TPU grouped matmul; its gradients run it transposed and the rhs-gradient kernel."""
  sizes = jnp.array([3, 0, 5], jnp.int32)
  impl = ragged_tpu.MosaicTpuRaggedDot(interpret=True)

  def f(lhs, rhs):
    return tokamax.ragged_dot(lhs, rhs, sizes, precision=precision, implementation=impl).sum()

  return f, (jnp.ones((8, 128), f32), jnp.ones((3, 128, 128), f32))


CALLS = {
  "attention-mosaic_tpu": _tpu_attention,
  "loss-mosaic_tpu": _tpu_loss,
  "ragged_dot-mosaic_tpu": _tpu_ragged,
  "attention-xla": lambda p: _attention("xla", p),
  "attention-xla_chunked": lambda p: _attention("xla_chunked", p),
  "loss-xla": lambda p: _loss("xla", p),
  "loss-chunked_xla": lambda p: _loss("chunked_xla", p),
  "glu-xla-fused": lambda p: _glu("xla", p),
  "glu-xla-split": lambda p: _glu("xla", p, split=True),
  "ragged_dot-xla": lambda p: _ragged("xla", p),
  "ragged_dot-xla-rhs_transposed": lambda p: _ragged("xla", p, "rhs_transposed"),
  "ragged_dot-xla-ragged_contracting": lambda p: _ragged("xla", p, "ragged_contracting"),
  "ragged_dot-xla-public_ragged_dot": lambda p: _ragged_default_layout("xla", p),
}


@pytest.mark.parametrize("precision", (HIGHEST, "highest"), ids=("enum", "string"))
@pytest.mark.parametrize("name", CALLS)
def test_precision_reaches_every_matmul_of_forward_and_backward(name, precision):
  f, args = CALLS[name](precision)
  forward = _precisions(f, *args)
  backward = _precisions(jax.grad(f, argnums=tuple(range(len(args)))), *args)
  assert forward and len(backward) > len(forward), (forward, backward)
  for where, found in (("forward", forward), ("backward", backward)):
    assert all(p == (HIGHEST, HIGHEST) for p in found), f"{where}: {found}"


@pytest.mark.parametrize("name", CALLS)
def test_no_precision_leaves_the_default(name):
  """No `precision` leaves every matmul at the ambient default: what a plain matmul records
  in the same context (None; HIGHEST under the core suite's accelerator fixture)."""
  f, args = CALLS[name](None)
  (ambient,) = _precisions(jnp.matmul, jnp.ones((2, 2), f32), jnp.ones((2, 2), f32))
  found = _precisions(jax.grad(f), *args)
  assert found and all(p == ambient for p in found), found


def test_triton_input_precision_follows_jax_precision():
  """A float32 tl.dot: HIGHEST is IEEE, HIGH three tf32 passes, DEFAULT one; a pair counts its
  higher half; None follows `jax.default_matmul_precision`; 16-bit inputs have no choice."""
  from tokamax._src import numerics

  P = jax.lax.Precision
  assert numerics.triton_input_precision(f32, P.HIGHEST) == "ieee"
  assert numerics.triton_input_precision(f32, P.HIGH) == "tf32x3"
  assert numerics.triton_input_precision(f32, P.DEFAULT) == "tf32"
  assert numerics.triton_input_precision(f32, (P.DEFAULT, P.HIGH)) == "tf32x3"
  assert numerics.triton_input_precision(jnp.bfloat16, P.DEFAULT) == "ieee"
  for configured, expected in (("highest", "ieee"), ("high", "tf32x3"), ("default", "tf32")):
    with jax.default_matmul_precision(configured):
      assert numerics.triton_input_precision(f32, None) == expected, configured
      # A pair of Nones follows the configured precision too.
      assert numerics.triton_input_precision(f32, (None, None)) == expected, configured
  # Nothing configured is JAX's DEFAULT: one tf32 pass, as XLA's own float32 GPU matmuls.
  with jax.default_matmul_precision(None):
    assert numerics.triton_input_precision(f32, None) == "tf32"


def test_triton_input_precision_of_dot_algorithm_presets():
  """A configured preset: F32_F32_F32 is IEEE; a bfloat16-input preset is not."""
  from tokamax._src import numerics

  with jax.default_matmul_precision("F32_F32_F32"):
    assert numerics.triton_input_precision(f32, None) == "ieee"
  with jax.default_matmul_precision("BF16_BF16_F32"):
    assert numerics.triton_input_precision(f32, None) == "tf32"


@pytest.mark.parametrize(
  ("preset", "want"),
  [
    ("F64_F64_F64", "ieee"),
    ("BF16_BF16_F32_X9", "ieee"),
    ("BF16_BF16_F32_X6", "ieee"),
    ("BF16_BF16_F32_X3", "tf32x3"),
    ("TF32_TF32_F32_X3", "tf32x3"),
    ("TF32_TF32_F32", "tf32"),
    ("F16_F16_F32", "tf32"),
  ],
)
def test_multi_pass_and_wide_presets_keep_their_accuracy_in_triton(preset, want):
  """Presets of several passes or wide inputs are not demoted to one tf32 pass."""
  from tokamax._src import numerics

  with jax.default_matmul_precision(preset):
    assert numerics.triton_input_precision(f32, None) == want


def test_mosaic_gpu_attention_delta_is_not_a_float32_dot():
  """The Mosaic GPU backward's delta (sum over H of out * dout, float32): a float32 dot there
  runs at the ambient precision, one tf32 pass on a GPU; a product and a sum are exact."""
  from tokamax._src.ops.attention import mosaic as attention_mosaic

  q = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
  kv = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
  impl = attention_mosaic.interpret_op()

  def f(q, k, v):
    return tokamax.dot_product_attention(q, k, v, implementation=impl).astype(f32).sum()

  jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, kv, kv).jaxpr
  float32_dots = [
    e
    for e in jaxprs.equations(jaxpr)
    if e.primitive.name == "dot_general"
    and any(v.aval.dtype == f32 for v in e.invars)
    and e.params["precision"] not in ((HIGHEST, HIGHEST),)
  ]
  assert not float32_dots, float32_dots
