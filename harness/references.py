"""Independent reference implementations of every op, for comparisons.

Written from the ops' definitions with no tokamax code, in the most direct form
(explicit head repetition, explicit index grids, dense one-hot matrices), so a
shared bug cannot hide. `high_precision` runs them in float64 where the
platform has it (float32 otherwise) at HIGHEST matmul precision.
"""

import contextlib
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

_HIGHEST = jax.lax.Precision.HIGHEST


def high_precision_dtype() -> np.dtype:
  """float64 except on TPU, which has no float64 arithmetic."""
  return np.dtype(np.float32 if jax.default_backend() == "tpu" else np.float64)


@contextlib.contextmanager
def _precision_scope():
  with (
    jax.enable_x64(high_precision_dtype() == np.float64),
    jax.default_matmul_precision("highest"),
  ):
    yield


def _upcast(x):
  if x is None or not hasattr(x, "dtype"):
    return x
  x = np.asarray(x)
  # jnp.issubdtype, not np's: numpy does not count bfloat16 as floating.
  return x.astype(high_precision_dtype()) if jnp.issubdtype(x.dtype, jnp.floating) else x


def high_precision(fn: Callable) -> Callable:
  """Runs `fn` on float inputs upcast to high precision; returns numpy arrays."""

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with _precision_scope():
      args = jax.tree.map(_upcast, args, is_leaf=lambda x: x is None)
      kwargs = {k: jax.tree.map(_upcast, v, is_leaf=lambda x: x is None) for k, v in kwargs.items()}
      return jax.tree.map(np.asarray, fn(*args, **kwargs))

  return wrapped


def high_precision_vjp(fn: Callable, primals: Sequence, cotangent) -> tuple:
  """The value and the VJP of `fn` at `primals` (a tuple of arrays), in high precision."""
  with _precision_scope():
    primals = jax.tree.map(_upcast, tuple(primals))
    out, vjp = jax.vjp(fn, *primals)
    grads = vjp(jnp.asarray(_upcast(cotangent)))
    return np.asarray(out), jax.tree.map(np.asarray, grads)


# --- attention ---------------------------------------------------------------


def attention(
  query,
  key,
  value,
  bias=None,
  mask=None,
  *,
  scale=None,
  is_causal=False,
  query_seq_lengths=None,
  key_value_seq_lengths=None,
  local_window_size=None,
  logits_soft_cap=None,
):
  """softmax(scale q.k + bias [soft-capped], masked) v; rows seeing no key are zero."""
  *batch, t, n, h = query.shape
  s, kh = key.shape[-3], key.shape[-2]
  repeat = n // kh
  key = jnp.repeat(key, repeat, axis=-2)
  value = jnp.repeat(value, repeat, axis=-2)
  if scale is None:
    scale = 1.0 / np.sqrt(h)
  logits = jnp.einsum("...tnh,...snh->...nts", query, key, precision=_HIGHEST) * scale
  if bias is not None:
    logits = logits + bias
  if logits_soft_cap is not None:
    logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
  i = np.arange(t)[:, None]
  j = np.arange(s)[None, :]
  allowed = positional_visibility(
    np.arange(t), np.arange(s), is_causal=is_causal, local_window_size=local_window_size
  )
  allowed = jnp.broadcast_to(jnp.asarray(allowed), (*batch, n, t, s))
  if mask is not None:
    allowed = allowed & mask
  if key_value_seq_lengths is not None:
    kv = jnp.asarray(key_value_seq_lengths)[..., None, None, None]
    allowed = allowed & (jnp.asarray(j) < kv)
  if query_seq_lengths is not None:
    ql = jnp.asarray(query_seq_lengths)[..., None, None, None]
    allowed = allowed & (jnp.asarray(i) < ql)
  logits = jnp.where(allowed, logits, -jnp.inf)
  top = jnp.max(logits, axis=-1, keepdims=True)
  top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
  weights = jnp.where(allowed, jnp.exp(logits - top), 0.0)
  total = weights.sum(-1, keepdims=True)
  probs = weights / jnp.where(total > 0, total, 1.0)
  return jnp.einsum("...nts,...snh->...tnh", probs, value, precision=_HIGHEST)


def positional_visibility(rows, cols, *, is_causal=False, local_window_size=None) -> np.ndarray:
  """bool [len(rows), len(cols)]: whether query position rows[a] may see key position cols[b]
  by the causal mask and the local window alone (an int window is (w, w))."""
  i, j = np.asarray(rows)[:, None], np.asarray(cols)[None, :]
  allowed = np.ones((i.shape[0], j.shape[1]), bool)
  if is_causal:
    allowed &= j <= i
  if local_window_size is not None:
    left, right = (
      (local_window_size,) * 2 if isinstance(local_window_size, int) else local_window_size
    )
    allowed &= (j >= i - left) & (j <= i + right)
  return allowed


def attention_visible_rows(
  t, s, *, is_causal=False, local_window_size=None, query_seq_lengths=None
) -> np.ndarray:
  """Rows [.., T] that see at least one key by position alone (for unwritten-output checks)."""
  allowed = positional_visibility(
    np.arange(t), np.arange(s), is_causal=is_causal, local_window_size=local_window_size
  )
  rows = allowed.any(-1)
  if query_seq_lengths is not None:
    rows = rows & (np.arange(t) < np.asarray(query_seq_lengths)[..., None])
  return rows


# --- normalisation -----------------------------------------------------------


def layer_norm(x, scale, offset, *, axis=-1, epsilon=1e-6, scale_offset=0.0, subtract_mean=True):
  """(x - mean) / sqrt(var + eps) * (scale + scale_offset) + offset along `axis`."""
  x = jnp.moveaxis(x, axis, -1)
  d = x.shape[-1]
  mean = x.sum(-1, keepdims=True) / d if subtract_mean else 0.0
  centred = x - mean
  var = (centred**2).sum(-1, keepdims=True) / d
  y = centred / jnp.sqrt(var + epsilon)
  if scale is not None:
    y = y * (scale + scale_offset)
  elif scale_offset:
    y = y * (1.0 + scale_offset)
  if offset is not None:
    y = y + offset
  return jnp.moveaxis(y, -1, axis)


# --- gated linear unit -------------------------------------------------------


def gated_linear_unit(x, weights, *, activation=None):
  """activation(x @ w_gate) * (x @ w_up)."""
  if isinstance(weights, tuple | list):
    w_gate, w_up = weights
  else:
    w_gate, w_up = weights[:, 0, :], weights[:, 1, :]
  gate = jnp.matmul(x, w_gate, precision=_HIGHEST)
  up = jnp.matmul(x, w_up, precision=_HIGHEST)
  return (gate if activation is None else activation(gate)) * up


# --- ragged dot --------------------------------------------------------------


def _group_of_rows(m, group_sizes, group_offset, num_groups):
  """One-hot [M, G] of each row's local group (rows outside every local group: none)."""
  sizes = jnp.asarray(group_sizes)
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  rows = jnp.arange(m)[:, None]
  member = (rows >= starts[None, :]) & (rows < ends[None, :])  # [M, G_all]
  offset = 0 if group_offset is None else jnp.asarray(group_offset).reshape(())
  local = jnp.arange(sizes.shape[0]) - offset
  pick = (local[:, None] == jnp.arange(num_groups)[None, :]).astype(member.dtype)  # [G_all, G]
  return (member.astype(jnp.int32) @ pick.astype(jnp.int32)).astype(bool)


def ragged_dot_general(lhs, rhs, group_sizes, layout, group_offset=None, num_groups=None):
  """The three ragged layouts as dense one-hot-masked einsums.

  Args:
    lhs: [M, K].
    rhs: [G, K, N] ("default"), [G, N, K] ("rhs_transposed") or [M, N]
      ("ragged_contracting").
    group_sizes: [G_all] rows per group.
    layout: One of "default", "rhs_transposed", "ragged_contracting".
    group_offset: First group computed, or None.
    num_groups: Groups computed for "ragged_contracting" (default: all).

  Returns:
    [M, N] or [G, K, N].
  """
  m = lhs.shape[0]
  if layout == "ragged_contracting":
    g = num_groups or np.shape(group_sizes)[0]
    onehot = _group_of_rows(m, group_sizes, group_offset, g).astype(lhs.dtype)
    return jnp.einsum("mg,mk,mn->gkn", onehot, lhs, rhs, precision=_HIGHEST)
  if layout == "rhs_transposed":
    rhs = jnp.swapaxes(rhs, 1, 2)
  onehot = _group_of_rows(m, group_sizes, group_offset, rhs.shape[0]).astype(lhs.dtype)
  return jnp.einsum("mg,mk,gkn->mn", onehot, lhs, rhs, precision=_HIGHEST)


# --- loss ----------------------------------------------------------------------


def linear_softmax_cross_entropy_loss(x, labels, weights, *, reduction="sum"):
  """-log softmax(x @ W)[label], reduced."""
  logits = jnp.matmul(x, weights, precision=_HIGHEST)
  shifted = logits - jax.lax.stop_gradient(logits.max(-1, keepdims=True))
  log_probs = shifted - jnp.log(jnp.exp(shifted).sum(-1, keepdims=True))
  onehot = jax.nn.one_hot(labels, weights.shape[1], dtype=log_probs.dtype)
  per_row = -(log_probs * onehot).sum(-1)
  if reduction == "sum":
    return per_row.sum()
  if reduction == "mean":
    return per_row.mean()
  return per_row
