"""Pallas Mosaic TPU flash attention: forward, dq and dk/dv kernels.

Layout: query [B, N, T, H], key [B, K, S, H], value [B, K, S, hv] (heads before
the sequence, so a block is [rows, head dim]); query head n reads key/value
head n // G. T and S are padded to whole blocks by the caller; the sequence
lengths (scalar-prefetched, at most the unpadded T and S) hide padded rows and
keys.

The forward kernel keeps a running max and sum per query row (online softmax)
over the key blocks and returns the output and the log-sum-exp. The backward
recomputes the probabilities from the log-sum-exp: the dq kernel walks the key
blocks of a query block, the dk/dv kernel the query blocks (and the G query
heads) of a key block.

A bias and a boolean mask come as planes [B|1, N|1, T|1, S|1] (float32 and
int32, T and S padded like the sequences where not broadcast); a block of a
plane is [block_q|1, block_kv|1], broadcast in the kernel.

Blocks that no (row, key) pair of which is visible (causal, local window,
lengths) are skipped: the kernel does nothing there and the index maps repeat
the nearest visible block, so the pipeline fetches nothing new.

Of the visited blocks, those that every mask leaves whole (all rows and keys
within the lengths, on the visible side of the causal diagonal and inside the
window, no mask plane) skip the masking.

Row statistics (max, sum, log-sum-exp, delta) are [rows, 128] float32 arrays,
the value repeated across the lanes.
"""

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tokamax._src.ops import partitioning

LANES = 128


@dataclasses.dataclass(frozen=True)
class Params:
  """Static parameters of the kernels.

  Attributes:
    block_q: Query rows per block (a multiple of 8, 16 for 16-bit inputs).
    block_kv: Keys per block (a multiple of 128).
    scale: Logit scale.
    soft_cap: `soft_cap * tanh(logits / soft_cap)` where not None.
    causal: Key j visible to query i only if j <= i.
    window: (left, right): key j visible to query i only if i - left <= j <= i + right.
    precision: Matmul precision.
    bias: Whether a bias plane follows the inputs.
    mask: Whether a mask plane follows them (after the bias).
  """

  block_q: int
  block_kv: int
  scale: float
  soft_cap: float | None = None
  causal: bool = False
  window: tuple[int, int] | None = None
  precision: object = None
  bias: bool = False
  mask: bool = False


def _blocks(lo, hi, block: int, xp):
  """Block range [first, last] covering positions [lo, hi] (lo >= 0; empty if hi < lo)."""
  div = lax.div if xp is jnp else (lambda a, b: a // b)  # Non-negative: truncation is floor.
  first = div(lo, block)
  return first, xp.where(hi < lo, first - 1, div(xp.maximum(hi, -1) + block, block) - 1)


def kv_blocks(i, q_len, kv_len, p: Params, xp=jnp):
  """The key blocks [first, last] that query block `i` sees (empty when last < first).

  `xp` is jnp in the kernels and index maps, numpy in the cost model.
  """
  row_lo = i * p.block_q
  row_hi = xp.minimum(row_lo + p.block_q, q_len) - 1
  key_lo, key_hi = xp.int32(0), kv_len - 1
  if p.causal:
    key_hi = xp.minimum(key_hi, row_hi)
  if p.window is not None:
    left, right = p.window
    key_lo = xp.maximum(key_lo, row_lo - left)
    key_hi = xp.minimum(key_hi, row_hi + right)
  key_hi = xp.where(row_hi < row_lo, -1, key_hi)
  return _blocks(key_lo, key_hi, p.block_kv, xp)


def q_blocks(j, q_len, kv_len, p: Params, xp=jnp):
  """The query blocks [first, last] that see key block `j` (empty when last < first)."""
  key_lo = j * p.block_kv
  key_hi = xp.minimum(key_lo + p.block_kv, kv_len) - 1
  row_lo, row_hi = xp.int32(0), q_len - 1
  if p.causal:
    row_lo = xp.maximum(row_lo, key_lo)
  if p.window is not None:
    left, right = p.window
    row_lo = xp.maximum(row_lo, key_lo - right)
    row_hi = xp.minimum(row_hi, key_hi + left)
  row_hi = xp.where(key_hi < key_lo, -1, row_hi)
  return _blocks(row_lo, row_hi, p.block_q, xp)


def _clamp(x, first, last, count: int):
  """`x` moved into [first, last] (the first block when empty), within [0, count)."""
  return jnp.clip(jnp.maximum(jnp.minimum(x, last), first), 0, count - 1)


def _visible(i, j, q_len, kv_len, p: Params, mask_ref=None):
  """Which (row, key) pairs of query block i and key block j are visible: bool [bq, bk]."""
  shape = (p.block_q, p.block_kv)
  rows = i * p.block_q + lax.broadcasted_iota(jnp.int32, shape, 0)
  keys = j * p.block_kv + lax.broadcasted_iota(jnp.int32, shape, 1)
  ok = (rows < q_len) & (keys < kv_len)
  if p.causal:
    ok &= keys <= rows
  if p.window is not None:
    left, right = p.window
    ok &= (keys >= rows - left) & (keys <= rows + right)
  if mask_ref is not None:
    ok &= mask_ref[...] != 0
  return ok


def _whole(i, j, q_len, kv_len, p: Params):
  """Whether every (row, key) pair of query block i and key block j is visible (no plane)."""
  row_lo, key_lo = i * p.block_q, j * p.block_kv
  row_hi, key_hi = row_lo + p.block_q - 1, key_lo + p.block_kv - 1
  whole = (row_hi < q_len) & (key_hi < kv_len)
  if p.causal:
    whole &= key_hi <= row_lo
  if p.window is not None:
    left, right = p.window
    whole &= (key_lo >= row_hi - left) & (key_hi <= row_lo + right)
  return whole


def _visit(run, i, j, q_len, kv_len, p: Params, mask_ref, body) -> None:
  """Runs `body(ok)` where `run`: `ok` the visibility mask, or None on whole blocks."""
  if mask_ref is not None:
    pl.when(run)(lambda: body(_visible(i, j, q_len, kv_len, p, mask_ref)))
    return
  whole = _whole(i, j, q_len, kv_len, p)
  pl.when(run & ~whole)(lambda: body(_visible(i, j, q_len, kv_len, p)))
  pl.when(run & whole)(lambda: body(None))


def _logits(q, k, p: Params, bias_ref=None):
  """Soft-capped logits of q [bq, H] and k [bk, H] (plus the bias): float32 [bq, bk]."""
  s = lax.dot_general(
    q, k, (((1,), (1,)), ((), ())), precision=p.precision, preferred_element_type=jnp.float32
  )
  s = s * p.scale
  if bias_ref is not None:
    s = s + bias_ref[...]
  if p.soft_cap is not None:
    s = p.soft_cap * jnp.tanh(s / p.soft_cap)
  return s


def _dot(a, b, contract, p: Params):
  return lax.dot_general(
    a, b, (contract, ((), ())), precision=p.precision, preferred_element_type=jnp.float32
  )


def _lanes(x):
  """[rows, 1] -> [rows, LANES]."""
  return jnp.broadcast_to(x, (x.shape[0], LANES))


def _planes(refs, p: Params):
  """(bias ref or None, mask ref or None, the other refs) from the refs after the inputs."""
  refs = list(refs)
  bias_ref = refs.pop(0) if p.bias else None
  mask_ref = refs.pop(0) if p.mask else None
  return bias_ref, mask_ref, refs


def plane_specs(planes, p: Params, coords) -> list[pl.BlockSpec]:
  """BlockSpecs of the bias/mask planes; `coords(*grid, *prefetch)` gives (b, n, i, j)."""
  specs = []
  for x in planes:
    shape = x.shape
    block = (None, None, p.block_q if shape[2] > 1 else 1, p.block_kv if shape[3] > 1 else 1)

    def index_map(*idx, shape=shape):
      return tuple(c if d > 1 else 0 for c, d in zip(coords(*idx), shape, strict=True))

    specs.append(pl.BlockSpec(block, index_map))
  return specs


def _fwd_kernel(q_len_ref, kv_len_ref, q_ref, k_ref, v_ref, *refs, p):
  bias_ref, mask_ref, (o_ref, lse_ref, m_sc, l_sc, acc_sc) = _planes(refs, p)
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  q_len, kv_len = q_len_ref[b], kv_len_ref[b]
  first, last = kv_blocks(i, q_len, kv_len, p)

  @pl.when(j == 0)
  def _():
    m_sc[...] = jnp.full_like(m_sc, -jnp.inf)
    l_sc[...] = jnp.zeros_like(l_sc)
    acc_sc[...] = jnp.zeros_like(acc_sc)

  def accumulate(ok):
    s = _logits(q_ref[...], k_ref[...], p, bias_ref)
    if ok is not None:
      s = jnp.where(ok, s, -jnp.inf)
    m_prev, l_prev = m_sc[:, :1], l_sc[:, :1]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    probs = jnp.exp(s - m_safe)
    alpha = jnp.exp(m_prev - m_safe)
    l_sc[...] = _lanes(alpha * l_prev + jnp.sum(probs, axis=1, keepdims=True))
    m_sc[...] = _lanes(m_new)
    v = v_ref[...]
    acc_sc[...] = alpha * acc_sc[...] + _dot(probs.astype(v.dtype), v, ((1,), (0,)), p)

  _visit((j >= first) & (j <= last), i, j, q_len, kv_len, p, mask_ref, accumulate)

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    total = l_sc[:, :1]
    empty = total == 0.0
    safe = jnp.where(empty, 1.0, total)
    o_ref[...] = (acc_sc[...] / safe).astype(o_ref.dtype)
    lse_ref[...] = _lanes(jnp.where(empty, -jnp.inf, jnp.log(safe) + m_sc[:, :1]))


def _compiler_params(parallel: int, arbitrary: int, vmem_limit_bytes: int):
  return pltpu.CompilerParams(
    dimension_semantics=("parallel",) * parallel + ("arbitrary",) * arbitrary,
    vmem_limit_bytes=vmem_limit_bytes,
  )


def _query_major_maps(p: Params, g: int, nk: int):
  """Index maps of a (B, N, query block, key block) grid: (q_map, kv_map, coords).

  Key blocks outside a query block's visible range repeat the nearest visible one (no new
  DMA); `coords` gives (b, n, query block, key block) for the bias and mask planes. `g`
  query heads share a K/V head.
  """

  def kv_block(bb, i, j, q_len_ref, kv_len_ref):
    first, last = kv_blocks(i, q_len_ref[bb], kv_len_ref[bb], p)
    return _clamp(j, first, last, nk)

  def q_map(bb, nn, i, j, *_):
    return bb, nn, i, 0

  def kv_map(bb, nn, i, j, *prefetch):
    return bb, nn // g, kv_block(bb, i, j, *prefetch), 0

  def coords(bb, nn, i, j, *prefetch):
    return bb, nn, i, kv_block(bb, i, j, *prefetch)

  return q_map, kv_map, coords


def forward(q, k, v, q_len, kv_len, planes, p: Params, *, vmem_limit_bytes: int, interpret):
  """Attention output [B, N, T, hv] and log-sum-exp [B, N, T, LANES] (-inf: no key seen).

  Args:
    q: [B, N, T, H], T a multiple of `block_q`.
    k: [B, K, S, H], S a multiple of `block_kv`.
    v: [B, K, S, hv].
    q_len: int32 [B] query rows per batch (at most the unpadded T).
    kv_len: int32 [B] keys per batch (at most the unpadded S).
    planes: The bias and mask planes that `p` names, in that order.
    p: The kernel parameters.
    vmem_limit_bytes: Scoped VMEM that Mosaic may use.
    interpret: The TPU interpreter's params, or None to compile.
  """
  b, n, t, h = q.shape
  kh, s, hv = k.shape[1], k.shape[2], v.shape[3]
  g = n // kh
  bq, bk = p.block_q, p.block_kv
  nq, nk = t // bq, s // bk

  q_map, kv_map, coords = _query_major_maps(p, g, nk)
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=2,
    grid=(b, n, nq, nk),
    in_specs=[
      pl.BlockSpec((None, None, bq, h), q_map),
      pl.BlockSpec((None, None, bk, h), kv_map),
      pl.BlockSpec((None, None, bk, hv), kv_map),
      *plane_specs(planes, p, coords),
    ],
    out_specs=[
      pl.BlockSpec((None, None, bq, hv), q_map),
      pl.BlockSpec((None, None, bq, LANES), q_map),
    ],
    scratch_shapes=[
      pltpu.VMEM((bq, LANES), jnp.float32),
      pltpu.VMEM((bq, LANES), jnp.float32),
      pltpu.VMEM((bq, hv), jnp.float32),
    ],
  )
  operands = (q_len, kv_len, q, k, v, *planes)
  return pl.pallas_call(
    functools.partial(_fwd_kernel, p=p),
    out_shape=(
      partitioning.kernel_output((b, n, t, hv), q.dtype, *operands),
      partitioning.kernel_output((b, n, t, LANES), jnp.float32, *operands),
    ),
    grid_spec=grid_spec,
    compiler_params=_compiler_params(3, 1, vmem_limit_bytes),
    interpret=interpret,
    name="tokamax_flash_attention_fwd",
  )(*operands)


def _probs_and_dlogits(ok, q, k, v, do, lse, delta, p: Params, bias_ref):
  """Probabilities P and the logits' cotangent dS (float32 [bq, bk]); `ok` as `_visit`'s."""
  s = _logits(q, k, p, bias_ref)
  lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)  # Rows that see nothing: P = 0.
  probs = jnp.exp(s - lse)
  if ok is not None:
    probs = jnp.where(ok, probs, 0.0)
  dprobs = _dot(do, v, ((1,), (1,)), p)
  ds = probs * (dprobs - delta)
  if p.soft_cap is not None:
    capped = s / p.soft_cap
    ds = ds * (1.0 - capped * capped)
  return probs, ds


def _dq_kernel(q_len_ref, kv_len_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, p):
  bias_ref, mask_ref, (dq_ref, dq_sc) = _planes(refs, p)
  b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  q_len, kv_len = q_len_ref[b], kv_len_ref[b]
  first, last = kv_blocks(i, q_len, kv_len, p)

  @pl.when(j == 0)
  def _():
    dq_sc[...] = jnp.zeros_like(dq_sc)

  def accumulate(ok):
    k = k_ref[...]
    _, ds = _probs_and_dlogits(
      ok, q_ref[...], k, v_ref[...], do_ref[...], lse_ref[:, :1], delta_ref[:, :1], p, bias_ref
    )
    dq_sc[...] += _dot(ds.astype(k.dtype), k, ((1,), (0,)), p)

  _visit((j >= first) & (j <= last), i, j, q_len, kv_len, p, mask_ref, accumulate)

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    dq_ref[...] = (dq_sc[...] * p.scale).astype(dq_ref.dtype)


def _dkv_kernel(
  q_len_ref,
  kv_len_ref,
  q_ref,
  k_ref,
  v_ref,
  do_ref,
  lse_ref,
  delta_ref,
  *refs,
  p,
):
  bias_ref, mask_ref, (dk_ref, dv_ref, dk_sc, dv_sc) = _planes(refs, p)
  b, j, g, i = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
  q_len, kv_len = q_len_ref[b], kv_len_ref[b]
  first, last = q_blocks(j, q_len, kv_len, p)

  @pl.when((g == 0) & (i == 0))
  def _():
    dk_sc[...] = jnp.zeros_like(dk_sc)
    dv_sc[...] = jnp.zeros_like(dv_sc)

  def accumulate(ok):
    q, do = q_ref[...], do_ref[...]
    probs, ds = _probs_and_dlogits(
      ok, q, k_ref[...], v_ref[...], do, lse_ref[:, :1], delta_ref[:, :1], p, bias_ref
    )
    dv_sc[...] += _dot(probs.astype(do.dtype), do, ((0,), (0,)), p)
    dk_sc[...] += _dot(ds.astype(q.dtype), q, ((0,), (0,)), p)

  _visit((i >= first) & (i <= last), i, j, q_len, kv_len, p, mask_ref, accumulate)

  @pl.when((g == pl.num_programs(3) - 1) & (i == pl.num_programs(4) - 1))
  def _():
    dk_ref[...] = (dk_sc[...] * p.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def backward(
  q, k, v, do, lse, delta, q_len, kv_len, planes, p: Params, *, vmem_limit_bytes, interpret
):
  """(dq, dk, dv) in the layouts of q, k, v.

  Args:
    q, k, v, q_len, kv_len, planes, p, vmem_limit_bytes, interpret: As `forward`.
    do: The output's cotangent [B, N, T, hv] (the dtype of v).
    lse: The forward's log-sum-exp [B, N, T, LANES].
    delta: sum(do * out) per row, float32 [B, N, T, LANES].
  """
  b, n, t, h = q.shape
  kh, s, hv = k.shape[1], k.shape[2], v.shape[3]
  g = n // kh
  bq, bk = p.block_q, p.block_kv
  nq, nk = t // bq, s // bk
  common = dict(interpret=interpret)
  operands = (q_len, kv_len, q, k, v, do, lse, delta, *planes)
  output = lambda x: partitioning.kernel_output(x.shape, x.dtype, *operands)

  # dq: like the forward, grid (B, N, query blocks, key blocks).
  dq_q_map, dq_kv_map, dq_coords = _query_major_maps(p, g, nk)

  dq = pl.pallas_call(
    functools.partial(_dq_kernel, p=p),
    out_shape=output(q),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(b, n, nq, nk),
      in_specs=[
        pl.BlockSpec((None, None, bq, h), dq_q_map),
        pl.BlockSpec((None, None, bk, h), dq_kv_map),
        pl.BlockSpec((None, None, bk, hv), dq_kv_map),
        pl.BlockSpec((None, None, bq, hv), dq_q_map),
        pl.BlockSpec((None, None, bq, LANES), dq_q_map),
        pl.BlockSpec((None, None, bq, LANES), dq_q_map),
        *plane_specs(planes, p, dq_coords),
      ],
      out_specs=pl.BlockSpec((None, None, bq, h), dq_q_map),
      scratch_shapes=[pltpu.VMEM((bq, h), jnp.float32)],
    ),
    compiler_params=_compiler_params(3, 1, vmem_limit_bytes),
    name="tokamax_flash_attention_dq",
    **common,
  )(*operands)

  # dk/dv: grid (B, K, key blocks, query heads of the group, query blocks).
  def dkv_q_block(bb, j, i, q_len_ref, kv_len_ref):
    first, last = q_blocks(j, q_len_ref[bb], kv_len_ref[bb], p)
    return _clamp(i, first, last, nq)

  def dkv_q_map(bb, kk, j, gg, i, *prefetch):
    return bb, kk * g + gg, dkv_q_block(bb, j, i, *prefetch), 0

  def dkv_kv_map(bb, kk, j, gg, i, *_):
    return bb, kk, j, 0

  def dkv_coords(bb, kk, j, gg, i, *prefetch):
    return bb, kk * g + gg, dkv_q_block(bb, j, i, *prefetch), j

  dk, dv = pl.pallas_call(
    functools.partial(_dkv_kernel, p=p),
    out_shape=(output(k), output(v)),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(b, kh, nk, g, nq),
      in_specs=[
        pl.BlockSpec((None, None, bq, h), dkv_q_map),
        pl.BlockSpec((None, None, bk, h), dkv_kv_map),
        pl.BlockSpec((None, None, bk, hv), dkv_kv_map),
        pl.BlockSpec((None, None, bq, hv), dkv_q_map),
        pl.BlockSpec((None, None, bq, LANES), dkv_q_map),
        pl.BlockSpec((None, None, bq, LANES), dkv_q_map),
        *plane_specs(planes, p, dkv_coords),
      ],
      out_specs=[
        pl.BlockSpec((None, None, bk, h), dkv_kv_map),
        pl.BlockSpec((None, None, bk, hv), dkv_kv_map),
      ],
      scratch_shapes=[pltpu.VMEM((bk, h), jnp.float32), pltpu.VMEM((bk, hv), jnp.float32)],
    ),
    compiler_params=_compiler_params(3, 2, vmem_limit_bytes),
    name="tokamax_flash_attention_dkv",
    **common,
  )(*operands)
  return dq, dk, dv
