"""The dot_product_attention op.

Canonical layout: the batch dims of the public call are flattened into one, so
implementations see query [B,T,N,H], key [B,S,K,H], value [B,S,K,h], bias and
mask [B|1, N|1, T|1, S|1], sequence lengths [B]. Semantics shared by every
implementation:

- logits = scale * q.k + bias, then `soft_cap * tanh(logits / soft_cap)`.
- key j is visible to query i when the mask allows it, j <= i if causal (top-left
  aligned, as `jax.nn.dot_product_attention`), i - left <= j <= i + right for a
  local window, j < kv_seq_length and i < q_seq_length.
- a query row that sees no key outputs zeros (and gets zero gradient).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from tokamax._src import arguments, numerics, validation
from tokamax._src.ops import op
from tokamax._src.ops import partitioning as partitioning_lib

LAYOUT = "query [*B,T,N,H], key [*B,S,K,H], value [*B,S,K,h], bias/mask [*#B,#N,#T,#S]"


@arguments.op_arguments
class AttentionArgs:
  """Canonical arguments of `dot_product_attention`."""

  query: Float[Array, "B T N H"]
  key: Float[Array, "B S K H"]
  value: Float[Array, "B S K h"]
  bias: Float[Array, "#B #N #T #S"] | None
  mask: Bool[Array, "#B #N #T #S"] | None
  q_seq_lengths: Int[Array, " B"] | None
  kv_seq_lengths: Int[Array, " B"] | None
  scale: float = arguments.static()
  is_causal: bool = arguments.static()
  local_window: tuple[int, int] | None = arguments.static()
  soft_cap: float | None = arguments.static()
  precision: object = arguments.static()
  batch_shape: tuple[int, ...] = arguments.static()


def _batch_broadcast(name: str, x, batch_shape: tuple[int, ...], trailing: int):
  """Broadcasts the batch dims of `x` and flattens them into one (1 if all broadcast)."""
  if x.ndim < trailing:
    x = x.reshape((1,) * (trailing - x.ndim) + x.shape)
  lead = x.shape[: x.ndim - trailing]
  lead = (1,) * (len(batch_shape) - len(lead)) + tuple(lead)
  x = x.reshape(lead + x.shape[x.ndim - trailing :])
  if all(d == 1 for d in lead):
    return x.reshape((1, *x.shape[len(lead) :]))
  x = jnp.broadcast_to(x, batch_shape + x.shape[len(lead) :])
  return x.reshape((math.prod(batch_shape), *x.shape[len(batch_shape) :]))


def _is_int(value) -> bool:
  return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _window(local_window_size) -> tuple[int, int] | None:
  if local_window_size is None:
    return None
  # Floats and bools are refused, not truncated: a window of 1.5 keys has no meaning.
  if _is_int(local_window_size):
    window = (int(local_window_size), int(local_window_size))
  elif (
    isinstance(local_window_size, tuple | list)
    and len(local_window_size) == 2
    and all(_is_int(w) for w in local_window_size)
  ):
    window = tuple(int(w) for w in local_window_size)
  else:
    raise ValueError(
      f"`local_window_size` must be an int or a (left, right) pair, got {local_window_size!r}."
    )
  if min(window) < 0:
    raise ValueError(f"`local_window_size` must be non-negative, got {local_window_size!r}.")
  return window


def canonicalize(
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
  precision=None,
) -> AttentionArgs:
  q = validation.floating("query", query)
  k = validation.floating("key", key)
  v = validation.floating("value", value)
  for name, x in (("query", q), ("key", k), ("value", v)):
    validation.min_rank(name, x, 3, LAYOUT)
  if not q.ndim == k.ndim == v.ndim:
    raise ValueError(f"`query`, `key` and `value` must have one rank ({LAYOUT}).")
  validation.same_dtype(query=q, key=k, value=v)
  batch_shape = tuple(q.shape[:-3])
  *_, t, n, h = q.shape
  for name, x in (("key", k), ("value", v)):
    if tuple(x.shape[:-3]) != batch_shape:
      raise ValueError(f"`{name}` batch dims {x.shape[:-3]} differ from `query`'s {batch_shape}.")
  *_, s, kh, hk = k.shape
  if k.shape[-1] != h:
    raise ValueError(f"`key` head dim {hk} must equal `query` head dim {h}.")
  if v.shape[-3:-1] != (s, kh):
    raise ValueError(f"`value` shape {v.shape} must match `key` {k.shape} in S and K.")
  if n % kh:
    raise ValueError(f"query heads N={n} must be a multiple of key/value heads K={kh}.")
  b = math.prod(batch_shape)
  target = (*batch_shape, n, t, s)
  if bias is not None:
    bias = validation.floating("bias", bias)
    validation.broadcastable("bias", bias.shape, target, LAYOUT)
    bias = _batch_broadcast("bias", bias, batch_shape, 3)
  if mask is not None:
    mask = validation.as_array("mask", mask)
    if mask.dtype != jnp.bool_:
      raise TypeError(f"`mask` must be boolean, got {mask.dtype}.")
    validation.broadcastable("mask", mask.shape, target, LAYOUT)
    mask = _batch_broadcast("mask", mask, batch_shape, 3)
  lengths = {}
  for name, x in (
    ("query_seq_lengths", query_seq_lengths),
    ("key_value_seq_lengths", key_value_seq_lengths),
  ):
    if x is not None:
      x = validation.integer(name, x)
      validation.broadcastable(name, x.shape, batch_shape, "[*#B]")
      x = jnp.broadcast_to(x, batch_shape).reshape((b,)).astype(jnp.int32)
    lengths[name] = x
  if scale is None and h == 0:
    raise ValueError(
      "`query` head dim is 0: the default scale 1/sqrt(H) is undefined; pass `scale`."
    )
  scale = 1.0 / math.sqrt(h) if scale is None else validation.finite("scale", scale)
  if logits_soft_cap is not None:
    logits_soft_cap = validation.finite("logits_soft_cap", logits_soft_cap)
    if not logits_soft_cap > 0:
      raise ValueError(f"`logits_soft_cap` must be positive, got {logits_soft_cap!r}.")
  return AttentionArgs(
    query=q.reshape((b, t, n, h)),
    key=k.reshape((b, s, kh, h)),
    value=v.reshape((b, s, kh, v.shape[-1])),
    bias=bias,
    mask=mask,
    q_seq_lengths=lengths["query_seq_lengths"],
    kv_seq_lengths=lengths["key_value_seq_lengths"],
    scale=scale,
    is_causal=validation.flag("is_causal", is_causal),
    local_window=_window(local_window_size),
    soft_cap=logits_soft_cap,
    precision=validation.precision(precision),
    batch_shape=batch_shape,
  )


def empty_reason(args: AttentionArgs) -> str | None:
  """Why a kernel does not take `args`: an empty query, key or value (the XLA forms do), or
  None."""
  if any(0 in x.shape for x in (args.query, args.key, args.value)):
    return "empty query, key or value"
  return None


def finalize(args: AttentionArgs, out: jax.Array) -> jax.Array:
  return out.reshape((*args.batch_shape, *out.shape[1:]))


def visible(args: AttentionArgs, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array | None:
  """The visibility mask [B|1, N|1, Tq, Sk] from everything but `mask`, or None.

  `q_pos` and `k_pos` are the absolute positions of the query rows and key
  columns considered (so chunks can ask for their own slice).
  """
  qi = q_pos[:, None]
  kj = k_pos[None, :]
  ok = None

  def both(a, b):
    return b if a is None else a & b

  if args.is_causal:
    ok = both(ok, kj <= qi)
  if args.local_window is not None:
    left, right = args.local_window
    ok = both(ok, (kj >= qi - left) & (kj <= qi + right))
  ok = None if ok is None else ok[None, None]
  if args.kv_seq_lengths is not None:
    ok = both(ok, kj[None, None] < args.kv_seq_lengths[:, None, None, None])
  if args.q_seq_lengths is not None:
    ok = both(ok, qi[None, None] < args.q_seq_lengths[:, None, None, None])
  return ok


def visible_pairs(t: int, s: int, is_causal: bool, window: tuple[int, int] | None) -> float:
  """(query, key) pairs that the causal mask and the local window leave visible."""
  i = np.arange(t, dtype=np.int64)
  first, last = np.zeros_like(i), np.full_like(i, s - 1)
  if window is not None:
    first, last = np.maximum(first, i - window[0]), np.minimum(last, i + window[1])
  if is_causal:
    last = np.minimum(last, i)
  return float(np.maximum(last - first + 1, 0).sum())


def cost(args: AttentionArgs) -> op.Cost:
  b, t, n, h = args.query.shape
  s, hv = args.key.shape[1], args.value.shape[-1]
  flops = 2.0 * b * n * visible_pairs(t, s, args.is_causal, args.local_window) * (h + hv)
  itemsize = np.dtype(args.query.dtype).itemsize
  nbytes = itemsize * (args.query.size + args.key.size + args.value.size + b * t * n * hv)
  return op.Cost(flops=flops, bytes=float(nbytes))


def _full_lengths(field: str):
  """Integer inputs for timing: every sequence at its full length."""

  def make(args: AttentionArgs, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    del rng
    return np.full(shape, getattr(args, field).shape[1], np.int32)

  return make


def partitioning(args: AttentionArgs) -> partitioning_lib.Rule:
  """Batch and K/V heads (each with its query heads) split; sequences stay whole."""
  (b, t, n, _), s = args.query.shape, args.key.shape[1]
  heads = ("k", "g")  # Query head k * G + g attends to K/V head k.

  def broadcast(x):
    if x is None:
      return None
    full = (b, n, t, s)
    return tuple(
      label if x.shape[i] == full[i] else None for i, label in enumerate(("b", heads, "t", "s"))
    )

  return partitioning_lib.Rule(
    inputs={
      "query": ("b", "t", heads, "h"),
      "key": ("b", "s", "k", "h"),
      "value": ("b", "s", "k", "hv"),
      "bias": broadcast(args.bias),
      "mask": broadcast(args.mask),
      "q_seq_lengths": ("b",),
      "kv_seq_lengths": ("b",),
    },
    output=("b", "t", heads, "hv"),
    split=frozenset(("b", "k")),
  )


def gradient_preference(args: AttentionArgs, platform: str) -> tuple[str, ...]:
  """The names `implementation=None` differentiates through on a GPU with a bias or mask.

  The forward keeps the default order there: Mosaic's, which streams bias and mask
  planes through shared memory, measured fastest (H200, B4 T4096 N32 H128 bf16,
  bench/results/h200/attention_staged_fwd_363862e.json: bias [1,N,T,S] 2.48 ms, mask [B,1,T,S]
  2.19, both 2.88, against cuDNN's 3.59, 3.33 and 6.30). Under differentiation, with a
  bias, Triton first: its backward writes the bias gradient in the kernel, where
  Mosaic's takes it from XLA over [B,N,T,S] (forward+backward 14.5 ms against 25.2,
  bench_run_2ccd979.json). With a mask alone, the deterministic kernels, Mosaic first
  (10.5 ms against Triton's 13.2 and cuDNN's 12.6). Elsewhere the forward's pick ().
  """
  if platform != "gpu" or (args.bias is None and args.mask is None):
    return ()
  names = SPEC.default_order(platform)
  if args.bias is not None:
    return op.move_first("triton", names)
  return tuple(n for n in names if n != "cudnn")


SPEC = op.OpSpec(
  name="dot_product_attention",
  canonicalize=canonicalize,
  implementations={
    "xla": "tokamax._src.ops.attention.xla:XlaAttention",
    "xla_chunked": "tokamax._src.ops.attention.xla_chunked:XlaChunkedAttention",
    "cudnn": "tokamax._src.ops.attention.cudnn:CudnnAttention",
    "triton": "tokamax._src.ops.attention.triton:TritonAttention",
    "mosaic": "tokamax._src.ops.attention.mosaic:MosaicAttention",
    "mosaic_tpu": "tokamax._src.ops.attention.mosaic_tpu:MosaicTpuAttention",
  },
  preference={"gpu": ("mosaic", "cudnn", "triton"), "tpu": ("mosaic_tpu",)},
  gradient_preference=gradient_preference,
  platform_names={"mosaic": {"tpu": "mosaic_tpu"}},
  cost=cost,
  finalize=finalize,
  integer_inputs={"q_seq_lengths": _full_lengths("query"), "kv_seq_lengths": _full_lengths("key")},
  partitioning=partitioning,
)


def logits_and_mask(
  args: AttentionArgs, q, k, bias, mask, q_pos, k_pos
) -> tuple[jax.Array, jax.Array | None]:
  """Soft-capped logits [B,K,G,Tq,Sk] (float32 or wider) and their visibility mask."""
  b, tq, n, h = q.shape
  kh = k.shape[2]
  qg = q.reshape(b, tq, kh, n // kh, h)
  logits = row_products(qg, k, args.precision, numerics.accumulation_dtype(q.dtype))
  logits = logits * args.scale
  if bias is not None:
    logits = logits + _grouped(bias.astype(logits.dtype), kh)
  if args.soft_cap is not None:
    logits = args.soft_cap * jnp.tanh(logits / args.soft_cap)
  ok = visible(args, q_pos, k_pos)
  if mask is not None:
    ok = mask if ok is None else ok & mask
  return logits, None if ok is None else _grouped(ok, kh)


def row_products(x: jax.Array, y: jax.Array, precision, dtype) -> jax.Array:
  """x [B,T,K,G,H] . y [B,S,K,H] over H as [B,K,G,T,S].

  An explicit dot_general: `jnp.einsum` may swap the operands, and XLA then lays the
  product out with T minor, which turns the softmax's row reductions into column ones
  and keeps XLA's GPU softmax fusion from forming (1.47x the forward time on the H200).
  """
  x = jnp.transpose(x, (0, 2, 3, 1, 4))
  return jax.lax.dot_general(
    x, y, (((4,), (3,)), ((0, 1), (0, 2))), precision=precision, preferred_element_type=dtype
  )


def output_delta(out: jax.Array, dout: jax.Array) -> jax.Array:
  """The backward's delta: sum over H of out [B,T,N,H] * dout, in float32, as [B,N,T].

  A product and a sum, not an einsum, which could run as a reduced-precision (tf32) dot.
  """
  return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), axis=-1).transpose(0, 2, 1)


def slice_unless_broadcast(x: jax.Array | None, axis: int, start, size: int) -> jax.Array | None:
  """`size` entries of `x` along `axis` from `start`; `x` itself where that axis is broadcast
  (size 1) or `x` is None."""
  if x is None or x.shape[axis] == 1:
    return x
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def _grouped(x: jax.Array, kh: int) -> jax.Array:
  """[B|1, N|1, T, S] -> [B|1, K|1, G|1, T, S]."""
  b, n, t, s = x.shape
  if n == 1:
    return x[:, :, None]
  return x.reshape(b, kh, n // kh, t, s)
