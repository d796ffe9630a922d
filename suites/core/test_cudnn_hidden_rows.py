"""cuDNN attention's guard for rows that see no key: zero output and zero cotangent there.

cuDNN itself runs only on NVIDIA GPUs (the matrix's `empty_rows`, `q_lengths` and
`kv_lengths` features check it there); the guard and the lengths it passes are plain JAX,
checked here against hand-made expectations.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax._src.ops.attention import cudnn, spec

B, T, S, N, H = 2, 6, 5, 3, 4


def _args(mask=None, **kw):
  q = jnp.zeros((B, T, N, H), jnp.bfloat16)
  kv = jnp.zeros((B, S, N, H), jnp.bfloat16)
  return spec.canonicalize(q, kv, kv, mask=None if mask is None else jnp.asarray(mask), **kw)


def _seen_by_hand(mask, is_causal, window, q_len, kv_len) -> np.ndarray:
  """[B, T, N, 1] by looping over every (row, key)."""
  seen = np.zeros((B, T, N, 1), bool)
  for b, i, n, j in itertools.product(range(B), range(T), range(N), range(S)):
    ok = mask is None or mask[min(b, mask.shape[0] - 1), min(n, mask.shape[1] - 1), i, j]
    ok = ok and not (is_causal and j > i)
    ok = ok and (window is None or i - window[0] <= j <= i + window[1])
    ok = ok and (kv_len is None or j < kv_len[b]) and (q_len is None or i < q_len[b])
    seen[b, i, n, 0] |= ok
  return seen


@pytest.mark.parametrize("mask_shape", [(B, 1, T, S), (1, N, T, S), (B, N, T, S)])
def test_hidden_rows_get_zero_output_and_zero_cotangent(mask_shape):
  mask = np.random.default_rng(0).random(mask_shape) < 0.7
  mask[..., 2, :] = False  # Row 2 sees no key for every batch and head.
  mask[..., 4, :] = True
  args = _args(mask)
  out = jax.random.normal(jax.random.key(0), (B, T, N, H))
  dout = jax.random.normal(jax.random.key(1), (B, T, N, H))
  y, vjp = jax.vjp(lambda o: cudnn.zero_unseen_rows(o, args), out)
  (dx,) = vjp(dout)
  visible = np.broadcast_to(np.moveaxis(mask.any(-1), -1, 1)[..., None], out.shape)
  np.testing.assert_array_equal(np.asarray(y), np.where(visible, out, 0.0))
  np.testing.assert_array_equal(np.asarray(dx), np.where(visible, dout, 0.0))
  assert not np.asarray(y)[:, 2].any() and np.asarray(y)[:, 4].all()


@pytest.mark.parametrize(
  "masked, is_causal, window, q_len, kv_len",
  [
    (False, True, (0, 0), None, None),  # Row 5 sees only key 5, and S = 5.
    (False, False, None, (4, 6), None),
    (False, False, None, None, (0, 3)),  # Batch 0 sees no key at all.
    (False, True, (1, 0), (5, 2), (2, 5)),  # Batch 0 rows 3.. fall past the window's keys.
    (True, True, None, None, None),  # The mask may hide a row's only causal keys.
    (True, False, None, (3, 6), (5, 1)),
  ],
)
def test_seen_rows_by_hand(masked, is_causal, window, q_len, kv_len):
  mask = None
  if masked:
    mask = np.random.default_rng(1).random((B, 1, T, S)) < 0.5
    mask[1, 0, 3, :4] = False  # Row 3 of batch 1 keeps only key 4, which causality hides.
  kw = dict(is_causal=is_causal, local_window_size=window)
  if q_len is not None:
    kw["query_seq_lengths"] = jnp.asarray(q_len, jnp.int32)
  if kv_len is not None:
    kw["key_value_seq_lengths"] = jnp.asarray(kv_len, jnp.int32)
  seen = cudnn.seen_rows(_args(mask, **kw))
  want = _seen_by_hand(mask, is_causal, window, q_len, kv_len)
  got = np.broadcast_to(np.asarray(seen), want.shape)
  np.testing.assert_array_equal(got, want)
  assert not want.all()  # Each case hides some row.


def test_causal_alone_hides_no_row():
  assert cudnn.seen_rows(_args(is_causal=True)) is None


def test_lengths_passed_both_and_clipped():
  args = _args(query_seq_lengths=jnp.asarray([9, -1], jnp.int32))
  got = cudnn._lengths(args)
  np.testing.assert_array_equal(np.asarray(got["query_seq_lengths"]), [T, 0])
  np.testing.assert_array_equal(np.asarray(got["key_value_seq_lengths"]), [S, S])
  assert all(v.dtype == jnp.int32 for v in got.values())
  assert cudnn._lengths(_args()) == {}
