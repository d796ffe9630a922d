"""The float64 references themselves."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from suites import opdb
from tokamax_harness import references


@pytest.mark.parametrize("dtype", (np.float16, jnp.bfloat16, np.float32))
def test_high_precision_upcasts_every_float_dtype(dtype):
  out = references.high_precision(lambda a: a * 3)(jnp.ones((2,), dtype))
  assert out.dtype == references.high_precision_dtype()


def test_reference_attention_matches_hand_computed_softmax():
  q = np.array([[[[1.0, 0.0]]]])  # [B=1, T=1, N=1, H=2]
  k = np.array([[[[1.0, 0.0]], [[0.0, 1.0]]]])  # S=2
  v = np.array([[[[2.0]], [[4.0]]]])
  out = references.high_precision(references.attention)(q, k, v, scale=1.0)
  w = np.exp([1.0, 0.0]) / np.exp([1.0, 0.0]).sum()
  np.testing.assert_allclose(out[0, 0, 0, 0], w @ [2.0, 4.0], rtol=1e-12)


def test_high_precision_runs_jax_code_in_float64():
  """1 + 1e-12 - 1 is 1e-12 in float64 and 0 in float32: jnp code too runs in float64."""
  out = references.high_precision(lambda a: (jnp.asarray(a) + 1e-12) - jnp.asarray(a))(
    jnp.ones((2,), jnp.float32)
  )
  assert out.dtype == np.float64
  np.testing.assert_allclose(out, 1e-12, rtol=1e-3)


def test_high_precision_upcasts_keyword_arguments():
  """A float32 keyword argument is upcast too: b + 1 - 1 keeps b = 1e-10 in float64 only."""
  fn = references.high_precision(lambda a, *, b: a * 0.0 + ((jnp.asarray(b) + 1.0) - 1.0))
  out = fn(jnp.ones((2,), jnp.float32), b=jnp.full((2,), 1e-10, jnp.float32))
  assert out.dtype == np.float64
  np.testing.assert_allclose(out, np.float32(1e-10), rtol=1e-5)


def test_high_precision_upcasts_arrays_inside_keyword_containers():
  """A keyword tuple of float32 arrays (like gated_linear_unit's (w_gate, w_up)) is upcast
  array by array: b + 1 - 1 keeps b = 1e-10 in float64 only."""
  fn = references.high_precision(lambda *, pair: ((jnp.asarray(pair[0]) + 1.0) - 1.0) + pair[1])
  out = fn(pair=(jnp.full((2,), 1e-10, jnp.float32), jnp.zeros((2,), jnp.float32)))
  assert out.dtype == np.float64
  np.testing.assert_allclose(out, np.float32(1e-10), rtol=1e-5)


@pytest.mark.parametrize(
  ("backend", "dtype"), [("cpu", np.float64), ("gpu", np.float64), ("tpu", np.float32)]
)
def test_high_precision_dtype_is_float64_except_on_tpu(monkeypatch, backend, dtype):
  monkeypatch.setattr(references.jax, "default_backend", lambda: backend)
  assert references.high_precision_dtype() == dtype


def test_reference_attention_caps_the_biased_logits():
  """The soft cap applies to scale * q.k + bias (bias first), checked by loops in numpy."""
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((1, 3, 1, 4)) for _ in range(3))
  bias = rng.standard_normal((1, 1, 3, 3)) * 4.0
  scale, cap = 0.7, 2.0
  out = references.high_precision(references.attention)(
    q, k, v, bias, scale=scale, logits_soft_cap=cap
  )
  want = np.zeros((3, 4))
  for i in range(3):
    logits = np.array(
      [cap * np.tanh((scale * q[0, i, 0] @ k[0, j, 0] + bias[0, 0, i, j]) / cap) for j in range(3)]
    )
    w = np.exp(logits - logits.max())
    want[i] = (w / w.sum()) @ v[0, :, 0]
  np.testing.assert_allclose(out[0, :, 0], want, rtol=1e-10)


def test_reference_layer_norm_scale_offset_without_scale():
  """With no scale the normalised value is multiplied by 1 + scale_offset (numpy, float64)."""
  x = np.random.default_rng(1).standard_normal((3, 8))
  out = references.high_precision(references.layer_norm)(x, None, None, scale_offset=0.5)
  centred = x - x.mean(-1, keepdims=True)
  want = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-6) * 1.5
  np.testing.assert_allclose(out, want, rtol=1e-10)


def test_reference_layer_norm_normalises_the_last_axis_of_three():
  """Statistics over the last axis of a [2, 3, 8] input, not its second (numpy, float64)."""
  x = np.random.default_rng(2).standard_normal((2, 3, 8))
  out = references.high_precision(references.layer_norm)(x, None, None)
  centred = x - x.mean(-1, keepdims=True)
  want = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(out, want, rtol=1e-10)


def test_reference_gated_linear_unit_by_hand():
  """activation(x @ w_gate) * (x @ w_up), for both weight layouts (numpy, float64)."""
  rng = np.random.default_rng(3)
  x, w = rng.standard_normal((4, 6)), rng.standard_normal((6, 2, 5))
  want = np.tanh(x @ w[:, 0, :]) * (x @ w[:, 1, :])
  glu = references.high_precision(references.gated_linear_unit)
  np.testing.assert_allclose(glu(x, w, activation=jnp.tanh), want, rtol=1e-10)
  np.testing.assert_allclose(
    glu(x, (w[:, 0, :], w[:, 1, :]), activation=jnp.tanh), want, rtol=1e-10
  )


def test_positional_visibility_by_hand():
  causal = references.positional_visibility(np.arange(3), np.arange(3), is_causal=True)
  np.testing.assert_array_equal(causal, [[1, 0, 0], [1, 1, 0], [1, 1, 1]])
  # An int window w is (w, w): |i - j| <= 1.
  band = references.positional_visibility(np.arange(4), np.arange(4), local_window_size=1)
  np.testing.assert_array_equal(band, [[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]])
  # (left, right) = (2, 0): i - 2 <= j <= i.
  left = references.positional_visibility(np.arange(4), np.arange(4), local_window_size=(2, 0))
  np.testing.assert_array_equal(left, [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1]])
  # (0, 1) on query rows 2, 3 of a longer key sequence: i <= j <= i + 1.
  right = references.positional_visibility(np.array([2, 3]), np.arange(5), local_window_size=(0, 1))
  np.testing.assert_array_equal(right, [[0, 0, 1, 1, 0], [0, 0, 0, 1, 1]])


def test_attention_visible_rows_by_hand():
  """Window (0, 0) over 4 queries and 2 keys: query i sees key i only, so rows 2, 3 see none;
  query lengths 1 and 3 cut rows from 1 and 3 on."""
  rows = references.attention_visible_rows(4, 2, local_window_size=(0, 0))
  np.testing.assert_array_equal(rows, [1, 1, 0, 0])
  rows = references.attention_visible_rows(4, 4, is_causal=True, query_seq_lengths=np.array([1, 3]))
  np.testing.assert_array_equal(rows, [[1, 0, 0, 0], [1, 1, 1, 0]])


def _numpy_attention(q, k, v, allowed, scale):
  """Loops in float64: per batch, head and query, softmax over the allowed keys (none: 0);
  head h reads key-value head h // (N / KH)."""
  b, t, n, _ = q.shape
  s, kh = k.shape[1], k.shape[2]
  out = np.zeros((b, t, n, v.shape[-1]))
  for bi in range(b):
    for hi in range(n):
      g = hi // (n // kh)
      for i in range(t):
        keys = [j for j in range(s) if allowed[bi, hi, i, j]]
        if not keys:
          continue
        logits = np.array([scale * q[bi, i, hi] @ k[bi, j, g] for j in keys])
        w = np.exp(logits - logits.max())
        out[bi, i, hi] = (w / w.sum()) @ v[bi, keys, g]
  return out


def test_reference_attention_masks_lengths_and_grouped_heads_by_hand():
  """Causal and an explicit mask together, key and query lengths per batch row, 4 query heads
  over 2 key-value heads: against loops that visit the allowed keys only."""
  rng = np.random.default_rng(2)
  b, t, s, n, kh, h = 2, 5, 6, 4, 2, 3
  q = rng.standard_normal((b, t, n, h))
  k = rng.standard_normal((b, s, kh, h))
  v = rng.standard_normal((b, s, kh, h))
  mask = rng.random((b, n, t, s)) < 0.7
  kv_lengths, q_lengths = np.array([6, 3]), np.array([4, 5])
  out = references.high_precision(references.attention)(
    q,
    k,
    v,
    mask=mask,
    is_causal=True,
    key_value_seq_lengths=kv_lengths,
    query_seq_lengths=q_lengths,
  )
  i, j = np.arange(t)[:, None], np.arange(s)[None, :]
  allowed = (
    mask & (j <= i) & (j < kv_lengths[:, None, None, None]) & (i < q_lengths[:, None, None, None])
  )
  want = _numpy_attention(q, k, v, allowed, 1.0 / np.sqrt(h))
  np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-12)


def test_high_precision_runs_matmuls_at_highest_precision():
  """float32 references (on TPU) need full-precision matmuls; the scope asks for them."""
  seen = []

  def fn(a):
    seen.append(jax.config.jax_default_matmul_precision)
    return a

  references.high_precision(fn)(np.ones(2))
  assert seen == ["highest"]


def test_reference_ragged_dot_by_hand():
  """Rows 0-1 in group 0 and rows 2-4 in group 1 of 6 rows (row 5 in no group: zero), against
  numpy row by row, in the three layouts, with a group offset and fewer groups computed."""
  rng = np.random.default_rng(3)
  lhs = rng.standard_normal((6, 2))
  rhs = rng.standard_normal((2, 2, 3))  # [G, K, N]
  sizes = np.array([2, 3])
  group = [0, 0, 1, 1, 1, None]
  ragged = references.high_precision(references.ragged_dot_general)

  want = np.stack([lhs[m] @ rhs[g] if g is not None else np.zeros(3) for m, g in enumerate(group)])
  np.testing.assert_allclose(ragged(lhs, rhs, sizes, "default"), want, rtol=1e-12, atol=1e-12)
  transposed = np.swapaxes(rhs, 1, 2)  # [G, N, K]
  np.testing.assert_allclose(
    ragged(lhs, transposed, sizes, "rhs_transposed"), want, rtol=1e-12, atol=1e-12
  )
  # group_offset 1: only group 1 is local (weights rhs[1:]); rows of group 0 are zero.
  local = np.stack([lhs[m] @ rhs[1] if g == 1 else np.zeros(3) for m, g in enumerate(group)])
  np.testing.assert_allclose(
    ragged(lhs, rhs[1:], sizes, "default", group_offset=np.array([1])),
    local,
    rtol=1e-12,
    atol=1e-12,
  )
  # Ragged contracting: out[g] = lhs[rows of g].T @ other[rows of g]; num_groups 1 keeps group 0.
  other = rng.standard_normal((6, 3))
  by_group = np.stack([lhs[0:2].T @ other[0:2], lhs[2:5].T @ other[2:5]])
  np.testing.assert_allclose(
    ragged(lhs, other, sizes, "ragged_contracting"), by_group, rtol=1e-12, atol=1e-12
  )
  np.testing.assert_allclose(
    ragged(lhs, other, sizes, "ragged_contracting", num_groups=1),
    by_group[:1],
    rtol=1e-12,
    atol=1e-12,
  )


@pytest.mark.parametrize(
  "op",
  [
    "dot_product_attention",
    "layer_norm",
    "gated_linear_unit",
    "ragged_dot",
    "linear_softmax_cross_entropy_loss",
  ],
)
def test_op_database_has_matmul_is_whether_the_reference_multiplies_matrices(op):
  """An op database entry's `has_matmul` (which gives float32 the accelerators' reduced
  matmul tolerance) says whether the op is matmul-based: whether its reference, traced at
  the golden shape, holds a dot_general."""
  info = opdb.get(op)
  feature = next(iter(info.features.values()))
  built = info.build(opdb.Draw(jax.random.key(0)), dict(info.golden_shape), "float32", feature)
  jaxpr = jax.make_jaxpr(lambda a: info.reference(a, built.kwargs))(built.args)
  assert info.has_matmul == ("dot_general" in str(jaxpr))
