"""Compiled GPU kernels against XLA or the float64 reference, outputs and gradients (GPU only).

The checks the former ci/gpu drivers ran on the H200 before timing
(attention_mosaic.py, mosaic_mm.py, triton_mm_norm.py): the Mosaic attention
over masking features, head dims, GQA, dtypes, lengths, bias and mask (with
broadcast planes); Mosaic ragged_dot over layouts and group offsets; Mosaic
GLU with either backward; Triton layer_norm, GLU and ragged_dot. Each compares
the compiled kernel on 16-bit (or float32) inputs with XLA on float32-upcast
inputs at HIGHEST precision, by relative Frobenius error, and checks that
outputs and gradients are bitwise deterministic where the kernel promises it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from suites import matrices, opdb
from suites.matrices import cases as cases_lib
from suites.matrices import checks
from tokamax._src.ops.ragged_dot import spec as rd_spec
from tokamax_harness import compare, hardware, references

pytestmark = pytest.mark.gpu
HIGHEST = jax.lax.Precision.HIGHEST


def _normal(key, shape, dtype, scale=1.0):
  return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _upcast(tree):
  return jax.tree.map(
    lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
  )


def _check_against(fn, ref_fn, args, argnums, *, out_tol, grad_tol, deterministic=True):
  """fn(*args) against ref_fn(*upcast args): outputs, VJP of a random cotangent, determinism."""
  out = jax.jit(fn)(*args)
  ref = jax.jit(ref_fn)(*_upcast(args))
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert compare.relative_error(out, ref) < out_tol
  if deterministic:
    assert np.array_equal(np.asarray(out), np.asarray(jax.jit(fn)(*args)))
  if not argnums:
    return
  ct = _normal(jax.random.key(7), out.shape, out.dtype)

  def grads(f, a, c):
    return jax.jit(jax.grad(lambda *p: jnp.sum(f(*p).astype(jnp.float32) * c), argnums))(*a)

  g1 = grads(fn, args, ct.astype(jnp.float32))
  gr = grads(ref_fn, _upcast(args), ct.astype(jnp.float32))
  for a, r in zip(jax.tree.leaves(g1), jax.tree.leaves(gr), strict=True):
    assert compare.relative_error(a, r) < grad_tol
  if deterministic:
    g2 = grads(fn, args, ct.astype(jnp.float32))
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
      assert np.array_equal(np.asarray(a), np.asarray(b))


# --- Mosaic attention -----------------------------------------------------------

# name -> `kernel_cases.AttentionKernelCase` (in the op database).
ATTENTION = opdb.get("dot_product_attention").kernel_cases["mosaic:gpu_compiled"]


def _attention_inputs(b, t, s, n, kh, h, dtype, kw):
  keys = jax.random.split(jax.random.key(b * 1000 + t + s + h), 6)
  q = _normal(keys[0], (b, t, n, h), dtype)
  k = _normal(keys[1], (b, s, kh, h), dtype)
  v = _normal(keys[2], (b, s, kh, h), dtype)
  kw = dict(kw)
  rng = np.random.default_rng(0)
  if kw.pop("lengths", False):
    kw["query_seq_lengths"] = jnp.asarray(rng.integers(t // 2, t + 1, b), jnp.int32)
    kw["key_value_seq_lengths"] = jnp.asarray(rng.integers(1, s + 1, b), jnp.int32)
  bias_shape, mask_shape = kw.pop("bias", None), kw.pop("mask", None)
  bias_shift = kw.pop("bias_shift", 0.0)
  bias = None if bias_shape is None else _normal(keys[3], bias_shape, jnp.float32, 2.0) + bias_shift
  mask = None
  if mask_shape is not None:  # About 30% of keys hidden, and every key of about 10% of rows.
    rows = (*mask_shape[:3], 1)
    mask = jax.random.bernoulli(keys[4], 0.7, mask_shape) & jax.random.bernoulli(keys[5], 0.9, rows)
  return (q, k, v, bias), mask, kw


@pytest.mark.op("dot_product_attention", "mosaic")
@pytest.mark.parametrize("name", list(ATTENTION))
def test_mosaic_attention_against_xla(name):
  case = ATTENTION[name]
  b, t, s, n, kh, h = (case.shape[x] for x in "btsnkh")
  args, mask, kw = _attention_inputs(b, t, s, n, kh, h, getattr(jnp, case.dtype), case.features)

  def fn(q, k, v, bias, impl="mosaic", precision=None):
    return tokamax.dot_product_attention(
      q, k, v, bias=bias, mask=mask, implementation=impl, precision=precision, **kw
    )

  ref = functools.partial(fn, impl="xla", precision=HIGHEST)
  argnums = (0, 1, 2) if args[3] is None else (0, 1, 2, 3)
  _check_against(fn, ref, args, argnums, out_tol=2e-2, grad_tol=5e-2)


# --- Mosaic ragged_dot and GLU --------------------------------------------------

RHS_SHAPES = {
  rd_spec.DEFAULT: lambda m, k, n, g: (g, k, n),
  rd_spec.RHS_TRANSPOSED: lambda m, k, n, g: (g, n, k),
  rd_spec.RAGGED_CONTRACTING: lambda m, k, n, g: (m, n),
}


@pytest.mark.op("ragged_dot", "mosaic")
@pytest.mark.parametrize(
  "layout, m, k, n, g, offset",
  [
    (case.layout, case.m, case.k, case.n, case.groups, case.group_offset)
    for case in opdb.get("ragged_dot").kernel_cases["mosaic:gpu_compiled"].values()
  ],
)
def test_mosaic_ragged_dot_against_float64(layout, m, k, n, g, offset):
  rng = np.random.default_rng(m + g)
  sizes = jnp.asarray(
    tokamax.generate_ragged_dot_group_sizes(m - 24, g + 2, seed=m, alpha=0.5, empty_fraction=0.25)
  )
  go = jnp.array([1], jnp.int32) if offset else None
  num_groups = g if layout != rd_spec.RAGGED_CONTRACTING else g + 2
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal(RHS_SHAPES[layout](m, k, n, g if offset else g + 2)))
  rhs = rhs.astype(jnp.bfloat16)
  dims = rd_spec.dimension_numbers(layout)
  fn = jax.jit(
    lambda a, b: tokamax.ragged_dot_general(
      a, b, sizes, dims, group_offset=go, implementation="mosaic"
    )
  )
  out, vjp = jax.vjp(fn, lhs, rhs)
  ct = jnp.asarray(rng.standard_normal(out.shape), jnp.bfloat16)
  grads = vjp(ct)
  ref, ref_grads = references.high_precision_vjp(
    lambda a, b: references.ragged_dot_general(
      a, b, sizes, layout, group_offset=go, num_groups=num_groups if offset else None
    ),
    (lhs, rhs),
    ct,
  )
  assert compare.relative_error(out, ref) < 1e-2
  for a, r in zip(grads, ref_grads, strict=True):
    assert np.isfinite(np.asarray(a, np.float32)).all()
    assert compare.relative_error(a, r) < 1e-2


@pytest.mark.op("gated_linear_unit", "mosaic")
@pytest.mark.parametrize(
  "m, k, n, tuple_weights, backward, activation",
  [
    (*case.x_shape, case.n, not case.fused, case.backward, case.activation)
    for case in opdb.get("gated_linear_unit").kernel_cases["mosaic:gpu_compiled"].values()
  ],
)
def test_mosaic_glu_against_float64(m, k, n, tuple_weights, backward, activation):
  from tokamax._src.ops.gated_linear_unit import mosaic as glu_mosaic

  rng = np.random.default_rng(m + k)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((k, 2, n)) / np.sqrt(k), jnp.bfloat16)
  weights = (w[:, 0], w[:, 1]) if tuple_weights else w
  kwargs = {} if backward is None else {"backward": backward}
  impl = glu_mosaic.MosaicGatedLinearUnit(**kwargs)
  fn = jax.jit(
    lambda a, b: tokamax.gated_linear_unit(a, b, activation=activation, implementation=impl)
  )
  out, vjp = jax.vjp(fn, x, weights)
  ct = jnp.asarray(rng.standard_normal(out.shape), jnp.bfloat16)
  dx, dw = vjp(ct)
  ref, (rx, rw) = references.high_precision_vjp(
    lambda a, b: references.gated_linear_unit(a, b, activation=activation), (x, weights), ct
  )
  assert compare.relative_error(out, ref) < 1e-2
  assert compare.relative_error(fn(x, weights), ref) < 1e-2  # The primal without residuals.
  assert compare.relative_error(dx, rx) < 1e-2
  for a, r in zip(jax.tree.leaves(dw), jax.tree.leaves(rw), strict=True):
    assert compare.relative_error(a, r) < 1e-2


# --- Mosaic loss: both gradients from the forward pass ---------------------------


@pytest.mark.op("linear_softmax_cross_entropy_loss", "mosaic")
@pytest.mark.parametrize(
  "b, h, v, reduction",
  [
    (1000, 512, 32832, "sum"),  # 4 row chunks of 256, the last partial; a 64-column tail.
    (2048, 1024, 32768, "mean"),  # Whole tiles; 8 chunks of 256 rows.
  ],
)
def test_mosaic_loss_gradient_in_forward_against_float64(b, h, v, reduction):
  """mosaic@grad_in_forward's pass over row chunks under the matrix's own VJP check."""
  op = "linear_softmax_cross_entropy_loss"
  info = opdb.get(op)
  (impl,) = [
    i
    for i in matrices.all_for(info.spec, hardware.detect(), info.config_variants)
    if i.label == "mosaic@grad_in_forward"
  ]
  case = cases_lib.Case(op, (("b", b), ("h", h), ("v", v)), "bfloat16", reduction, "h100")
  checks.check_vjp(case, impl)


# --- Triton layer_norm, GLU and ragged_dot --------------------------------------


def _triton_tol(dtype) -> float:
  return 2e-2 if jnp.dtype(dtype).itemsize == 2 else 1e-4


@pytest.mark.op("layer_norm", "triton")
@pytest.mark.parametrize(
  "dtype, shape, axis, variant",
  [
    (
      getattr(jnp, case.dtype),
      case.shape,
      case.axis,
      (case.subtract_mean, case.has_scale, case.has_offset, case.scale_offset),
    )
    for case in opdb.get("layer_norm").kernel_cases["triton:gpu_compiled"].values()
  ],
)
def test_triton_layer_norm_against_xla(dtype, shape, axis, variant):
  subtract_mean, has_scale, has_offset, scale_offset = variant
  keys = jax.random.split(jax.random.key(shape[0]), 3)
  d = shape[axis]
  x = _normal(keys[0], shape, dtype, 2.0) + jnp.asarray(0.5, dtype)
  scale = _normal(keys[1], (d,), dtype) if has_scale else None
  offset = _normal(keys[2], (d,), dtype) if has_offset else None
  kw = dict(axis=axis, subtract_mean=subtract_mean, scale_offset=scale_offset, epsilon=1e-5)

  def fn(x, scale, offset, impl="triton"):
    return tokamax.layer_norm(x, scale, offset, implementation=impl, **kw)

  argnums = tuple(i for i, a in enumerate((x, scale, offset)) if a is not None)
  tol = _triton_tol(dtype)
  _check_against(
    fn,
    functools.partial(fn, impl="xla"),
    (x, scale, offset),
    argnums,
    out_tol=tol,
    grad_tol=tol,
    deterministic=False,
  )


@pytest.mark.op("gated_linear_unit", "triton")
@pytest.mark.parametrize(
  "dtype, x_shape, k, n, activation, fused",
  [
    (getattr(jnp, case.dtype), case.x_shape, case.x_shape[-1], case.n, case.activation, case.fused)
    for case in opdb.get("gated_linear_unit").kernel_cases["triton:gpu_compiled"].values()
  ],
)
def test_triton_glu_against_xla(dtype, x_shape, k, n, activation, fused):
  keys = jax.random.split(jax.random.key(k + n), 2)
  x = _normal(keys[0], x_shape, dtype)
  w = _normal(keys[1], (k, 2, n), dtype, float(1 / np.sqrt(k)))
  weights = w if fused else (w[:, 0], w[:, 1])

  def fn(x, w, impl="triton"):
    return tokamax.gated_linear_unit(
      x, w, activation=activation, precision=HIGHEST, implementation=impl
    )

  tol = _triton_tol(dtype)
  _check_against(
    fn,
    functools.partial(fn, impl="xla"),
    (x, weights),
    (0, 1),
    out_tol=tol,
    grad_tol=tol,
    deterministic=False,
  )


@pytest.mark.op("ragged_dot", "triton")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("layout", [rd_spec.DEFAULT, rd_spec.RHS_TRANSPOSED])
@pytest.mark.parametrize("offset", [None, 2])
def test_triton_ragged_dot_against_xla(dtype, layout, offset):
  m, k, n, g = 1000, 256, 384, 8
  groups = g + 4 if offset is not None else g
  sizes = jnp.asarray(
    tokamax.generate_ragged_dot_group_sizes(900, groups, seed=3, empty_fraction=0.25)
  )
  keys = jax.random.split(jax.random.key(g), 2)
  lhs = _normal(keys[0], (m, k), dtype)
  rhs = _normal(keys[1], RHS_SHAPES[layout](m, k, n, g), dtype)
  extra = {} if offset is None else {"group_offset": jnp.array([offset], jnp.int32)}
  dims = rd_spec.dimension_numbers(layout)

  def fn(lhs, rhs, impl="triton"):
    return tokamax.ragged_dot_general(
      lhs, rhs, sizes, dims, precision=HIGHEST, implementation=impl, **extra
    )

  tol = _triton_tol(dtype)
  _check_against(
    fn,
    functools.partial(fn, impl="xla"),
    (lhs, rhs),
    (0, 1),
    out_tol=tol,
    grad_tol=tol,
    deterministic=False,
  )
