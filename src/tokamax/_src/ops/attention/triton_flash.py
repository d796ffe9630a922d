"""Flash attention kernels written in Triton: forward, dK/dV and dQ.

Layouts are the canonical ones of `spec.py`: q [B,T,N,H], k [B,S,K,H],
v [B,S,K,h], o and do [B,T,N,h], bias and mask [B|1,N|1,T|1,S|1] (broadcast dims
get stride 0), sequence lengths [B], and the log-sum-exp and delta [B,N,T] in
float32. Every shape, stride and feature flag is a `tl.constexpr`, so each
combination compiles to its own kernel and the loops carry no dead branches.

Logits are kept in base 2 (`s2 = log2(e) * logits`), and the stored
log-sum-exp is `m + log2(l)`; a query row that sees no key (or lies past its
sequence length) stores `+inf`, so the backward pass gives it `p = 0` without
masking. Key blocks that no row of a query block can see are skipped; blocks
that every row sees in full run without positional masks.

This module imports only `triton`, so it loads (and compiles for any target)
on a machine without a GPU.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _visible(rows, cols, kv_len, CAUSAL: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr):
  """Positional visibility of keys `cols` to queries `rows` (broadcasting)."""
  ok = cols < kv_len
  if CAUSAL:
    ok = ok & (cols <= rows)
  if LEFT >= 0:
    ok = ok & (cols >= rows - LEFT)
  if RIGHT >= 0:
    ok = ok & (cols <= rows + RIGHT)
  return ok


@triton.jit
def _load_tile(ptrs, rows, cols, NROWS, NCOLS, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
  """Loads a 2D tile, masking rows >= NROWS and cols >= NCOLS only when asked."""
  if CHECK_ROWS and CHECK_COLS:
    x = tl.load(ptrs, mask=(rows[:, None] < NROWS) & (cols[None, :] < NCOLS), other=0.0)
  elif CHECK_ROWS:
    x = tl.load(ptrs, mask=rows[:, None] < NROWS, other=0.0)
  elif CHECK_COLS:
    x = tl.load(ptrs, mask=cols[None, :] < NCOLS, other=0.0)
  else:
    x = tl.load(ptrs)
  return x


@triton.jit
def _scores(
  qk,
  bias_base,
  mask_base,
  rows,
  cols,
  kv_len,
  T: tl.constexpr,
  S: tl.constexpr,
  SCALE: tl.constexpr,
  SOFT_CAP: tl.constexpr,
  CAUSAL: tl.constexpr,
  LEFT: tl.constexpr,
  RIGHT: tl.constexpr,
  HAS_BIAS: tl.constexpr,
  BIAS_ST: tl.constexpr,
  BIAS_SS: tl.constexpr,
  HAS_MASK: tl.constexpr,
  MASK_ST: tl.constexpr,
  MASK_SS: tl.constexpr,
  MASKED: tl.constexpr,
):
  """Base-2 logits of a tile (-inf where invisible) and tanh of the soft cap.

  `rows` and `cols` are broadcastable index tensors of the tile's shape (the
  tile may be transposed: rows [1,M] with cols [N,1]).
  """
  if HAS_BIAS or SOFT_CAP > 0.0:
    x = qk * SCALE
    if HAS_BIAS:
      in_bounds = (rows < T) & (cols < S)
      offs = rows.to(tl.int64) * BIAS_ST + cols.to(tl.int64) * BIAS_SS
      x += tl.load(bias_base + offs, mask=in_bounds, other=0.0).to(tl.float32)
    if SOFT_CAP > 0.0:
      # tanh(y) = 1 - 2 / (exp(2y) + 1), exact at both infinities.
      th = 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E / SOFT_CAP)) + 1.0)
      s2 = th * (SOFT_CAP * LOG2E)
    else:
      th = x
      s2 = x * LOG2E
  else:
    s2 = qk * (SCALE * LOG2E)
    th = s2
  if MASKED:
    s2 = tl.where(_visible(rows, cols, kv_len, CAUSAL, LEFT, RIGHT), s2, float("-inf"))
  if HAS_MASK:
    in_bounds = (rows < T) & (cols < S)
    offs = rows.to(tl.int64) * MASK_ST + cols.to(tl.int64) * MASK_SS
    keep = tl.load(mask_base + offs, mask=in_bounds, other=0)
    s2 = tl.where(keep != 0, s2, float("-inf"))
  return s2, th


@triton.jit
def _key_range(
  m0,
  q_len,
  kv_len,
  BLOCK_M: tl.constexpr,
  BLOCK_N: tl.constexpr,
  CAUSAL: tl.constexpr,
  LEFT: tl.constexpr,
  RIGHT: tl.constexpr,
):
  """Key blocks for query rows [m0, m0+BLOCK_M): masked [lo, full_lo), full, masked [full_hi, hi)."""
  hi = kv_len
  if CAUSAL:
    hi = tl.minimum(hi, m0 + BLOCK_M)
  if RIGHT >= 0:
    hi = tl.minimum(hi, m0 + BLOCK_M + RIGHT)
  lo = m0 * 0
  if LEFT >= 0:
    lo = tl.maximum(m0 - LEFT, 0) // BLOCK_N * BLOCK_N
  hi = tl.where(m0 < q_len, tl.maximum(hi, lo), lo)
  full_hi = kv_len // BLOCK_N * BLOCK_N
  if CAUSAL:
    full_hi = tl.minimum(full_hi, (m0 + 1) // BLOCK_N * BLOCK_N)
  if RIGHT >= 0:
    full_hi = tl.minimum(full_hi, (m0 + RIGHT + 1) // BLOCK_N * BLOCK_N)
  full_lo = lo
  if LEFT >= 0:
    full_lo = tl.maximum(lo, tl.cdiv(tl.maximum(m0 + BLOCK_M - 1 - LEFT, 0), BLOCK_N) * BLOCK_N)
  full_lo = tl.minimum(full_lo, hi)
  full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
  return lo, full_lo, full_hi, hi


@triton.jit
def _query_range(
  n0,
  q_len,
  kv_len,
  T: tl.constexpr,
  BLOCK_M: tl.constexpr,
  BLOCK_N: tl.constexpr,
  CAUSAL: tl.constexpr,
  LEFT: tl.constexpr,
  RIGHT: tl.constexpr,
):
  """Query blocks for key rows [n0, n0+BLOCK_N): masked [lo, full_lo), full, masked [full_hi, hi)."""
  lo = n0 * 0
  if CAUSAL:
    lo = n0
  if RIGHT >= 0:
    lo = tl.maximum(lo, n0 - RIGHT)
  lo = tl.maximum(lo, 0) // BLOCK_M * BLOCK_M
  hi = q_len
  if LEFT >= 0:
    hi = tl.minimum(hi, n0 + BLOCK_N + LEFT)
  hi = tl.where(n0 < kv_len, tl.maximum(hi, lo), lo)
  full_lo = lo
  if CAUSAL:
    full_lo = tl.maximum(full_lo, tl.cdiv(n0 + BLOCK_N - 1, BLOCK_M) * BLOCK_M)
  if RIGHT >= 0:
    full_lo = tl.maximum(
      full_lo, tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - RIGHT, 0), BLOCK_M) * BLOCK_M
    )
  full_hi = hi * 0 + T // BLOCK_M * BLOCK_M
  if LEFT >= 0:
    full_hi = tl.minimum(full_hi, (n0 + LEFT + 1) // BLOCK_M * BLOCK_M)
  full_lo = tl.where(n0 + BLOCK_N <= kv_len, full_lo, hi)
  full_lo = tl.minimum(full_lo, hi)
  full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
  return lo, full_lo, full_hi, hi


@triton.jit
def _fwd_loop(
  acc,
  l_i,
  m_i,
  q,
  k_base,
  v_base,
  bias_base,
  mask_base,
  offs_m,
  kv_len,
  lo,
  hi,
  T: tl.constexpr,
  S: tl.constexpr,
  KH: tl.constexpr,
  H: tl.constexpr,
  HV: tl.constexpr,
  SCALE: tl.constexpr,
  SOFT_CAP: tl.constexpr,
  CAUSAL: tl.constexpr,
  LEFT: tl.constexpr,
  RIGHT: tl.constexpr,
  HAS_BIAS: tl.constexpr,
  BIAS_ST: tl.constexpr,
  BIAS_SS: tl.constexpr,
  HAS_MASK: tl.constexpr,
  MASK_ST: tl.constexpr,
  MASK_SS: tl.constexpr,
  DOT_PRECISION: tl.constexpr,
  MASKED: tl.constexpr,
  BLOCK_N: tl.constexpr,
  BLOCK_H: tl.constexpr,
  BLOCK_HV: tl.constexpr,
):
  offs_d = tl.arange(0, BLOCK_H)
  offs_dv = tl.arange(0, BLOCK_HV)
  for start_n in range(lo, hi, BLOCK_N):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load_tile(
      k_base + offs_n[:, None] * (KH * H) + offs_d[None, :],
      offs_n,
      offs_d,
      S,
      H,
      MASKED,
      BLOCK_H != H,
    )
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    s2, _ = _scores(
      qk,
      bias_base,
      mask_base,
      offs_m[:, None],
      offs_n[None, :],
      kv_len,
      T,
      S,
      SCALE,
      SOFT_CAP,
      CAUSAL,
      LEFT,
      RIGHT,
      HAS_BIAS,
      BIAS_ST,
      BIAS_SS,
      HAS_MASK,
      MASK_ST,
      MASK_SS,
      MASKED,
    )
    m_new = tl.maximum(m_i, tl.max(s2, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s2 - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_tile(
      v_base + offs_n[:, None] * (KH * HV) + offs_dv[None, :],
      offs_n,
      offs_dv,
      S,
      HV,
      MASKED,
      BLOCK_HV != HV,
    )
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    m_i = m_new
  return acc, l_i, m_i


@triton.jit
def _query_block(
  q_len_ptr,
  kv_len_ptr,
  T: tl.constexpr,
  S: tl.constexpr,
  N: tl.constexpr,
  KH: tl.constexpr,
  CAUSAL: tl.constexpr,
  HAS_Q_LEN: tl.constexpr,
  HAS_KV_LEN: tl.constexpr,
  BLOCK_M: tl.constexpr,
):
  """This program's (batch as int64, head, kv head, first row, q length, kv length).

  Programs run over (query block, head, batch); causal runs the heaviest blocks first.
  """
  NUM_M: tl.constexpr = (T + BLOCK_M - 1) // BLOCK_M
  pid = tl.program_id(0)
  m_blk = pid % NUM_M
  if CAUSAL:
    m_blk = NUM_M - 1 - m_blk
  bn = pid // NUM_M
  n = bn % N
  b = bn // N
  kh = n // (N // KH)
  m0 = m_blk * BLOCK_M
  b64 = b.to(tl.int64)
  q_len, kv_len = _sequence_lengths(q_len_ptr, kv_len_ptr, b, T, S, HAS_Q_LEN, HAS_KV_LEN)
  return b64, n, kh, m0, q_len, kv_len


@triton.jit
def _sequence_lengths(
  q_len_ptr,
  kv_len_ptr,
  b,
  T: tl.constexpr,
  S: tl.constexpr,
  HAS_Q_LEN: tl.constexpr,
  HAS_KV_LEN: tl.constexpr,
):
  """Batch `b`'s query and key/value lengths, clipped to [0, T] and [0, S]."""
  q_len = b * 0 + T
  if HAS_Q_LEN:
    q_len = tl.maximum(tl.minimum(tl.load(q_len_ptr + b), T), 0)
  kv_len = b * 0 + S
  if HAS_KV_LEN:
    kv_len = tl.maximum(tl.minimum(tl.load(kv_len_ptr + b), S), 0)
  return q_len, kv_len


@triton.jit
def fwd_kernel(
  q_ptr,
  k_ptr,
  v_ptr,
  bias_ptr,
  mask_ptr,
  q_len_ptr,
  kv_len_ptr,
  o_ptr,
  lse_ptr,
  T: tl.constexpr,
  S: tl.constexpr,
  N: tl.constexpr,
  KH: tl.constexpr,
  H: tl.constexpr,
  HV: tl.constexpr,
  SCALE: tl.constexpr,
  SOFT_CAP: tl.constexpr,
  CAUSAL: tl.constexpr,
  LEFT: tl.constexpr,
  RIGHT: tl.constexpr,
  HAS_BIAS: tl.constexpr,
  BIAS_SB: tl.constexpr,
  BIAS_SN: tl.constexpr,
  BIAS_ST: tl.constexpr,
  BIAS_SS: tl.constexpr,
  HAS_MASK: tl.constexpr,
  MASK_SB: tl.constexpr,
  MASK_SN: tl.constexpr,
  MASK_ST: tl.constexpr,
  MASK_SS: tl.constexpr,
  HAS_Q_LEN: tl.constexpr,
  HAS_KV_LEN: tl.constexpr,
  DOT_PRECISION: tl.constexpr,
  BLOCK_M: tl.constexpr,
  BLOCK_N: tl.constexpr,
  BLOCK_H: tl.constexpr,
  BLOCK_HV: tl.constexpr,
):
  """One program per (query block, head, batch); the heaviest causal blocks first."""
  b64, n, kh, m0, q_len, kv_len = _query_block(
    q_len_ptr, kv_len_ptr, T, S, N, KH, CAUSAL, HAS_Q_LEN, HAS_KV_LEN, BLOCK_M
  )

  offs_m = m0 + tl.arange(0, BLOCK_M)
  offs_d = tl.arange(0, BLOCK_H)
  offs_dv = tl.arange(0, BLOCK_HV)
  q = _load_tile(
    q_ptr + b64 * (T * N * H) + n * H + offs_m[:, None] * (N * H) + offs_d[None, :],
    offs_m,
    offs_d,
    T,
    H,
    True,
    BLOCK_H != H,
  )
  k_base = k_ptr + b64 * (S * KH * H) + kh * H
  v_base = v_ptr + b64 * (S * KH * HV) + kh * HV
  bias_base = bias_ptr + b64 * BIAS_SB + n.to(tl.int64) * BIAS_SN
  mask_base = mask_ptr + b64 * MASK_SB + n.to(tl.int64) * MASK_SN

  acc = tl.zeros([BLOCK_M, BLOCK_HV], dtype=tl.float32)
  l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
  m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
  lo, full_lo, full_hi, hi = _key_range(m0, q_len, kv_len, BLOCK_M, BLOCK_N, CAUSAL, LEFT, RIGHT)
  ranges = ((lo, full_lo, True), (full_lo, full_hi, False), (full_hi, hi, True))
  for i in tl.static_range(3):
    acc, l_i, m_i = _fwd_loop(
      acc,
      l_i,
      m_i,
      q,
      k_base,
      v_base,
      bias_base,
      mask_base,
      offs_m,
      kv_len,
      ranges[i][0],
      ranges[i][1],
      T,
      S,
      KH,
      H,
      HV,
      SCALE,
      SOFT_CAP,
      CAUSAL,
      LEFT,
      RIGHT,
      HAS_BIAS,
      BIAS_ST,
      BIAS_SS,
      HAS_MASK,
      MASK_ST,
      MASK_SS,
      DOT_PRECISION,
      ranges[i][2],
      BLOCK_N,
      BLOCK_H,
      BLOCK_HV,
    )

  valid = (l_i > 0.0) & (offs_m < q_len)
  l_safe = tl.where(valid, l_i, 1.0)
  out = tl.where(valid[:, None], acc / l_safe[:, None], 0.0)
  lse = tl.where(valid, m_i + tl.log2(l_safe), float("inf"))
  o_ptrs = o_ptr + b64 * (T * N * HV) + n * HV + offs_m[:, None] * (N * HV) + offs_dv[None, :]
  tl.store(
    o_ptrs, out.to(o_ptr.dtype.element_ty), mask=(offs_m[:, None] < T) & (offs_dv[None, :] < HV)
  )
  tl.store(lse_ptr + (b64 * N + n) * T + offs_m, lse, mask=offs_m < T)


@triton.jit
def _dkdv_loop(
  dk,
  dv,
  k,
  v,
  q_base,
  do_base,
  lse_base,
  delta_base,
  bias_base,
  mask_base,
  dbias_base,
  offs_n,
  kv_len,
  lo,
  hi,
  T: tl.constexpr,
  S: tl.constexpr,
  N: tl.constexpr,
  H: tl.constexpr,
  HV: tl.constexpr,
  SCALE: tl.constexpr,
  SOFT_CAP: tl.constexpr,
  CAUSAL: tl.constexpr,
  LEFT: tl.constexpr,
  RIGHT: tl.constexpr,
  HAS_BIAS: tl.constexpr,
  BIAS_ST: tl.constexpr,
  BIAS_SS: tl.constexpr,
  HAS_MASK: tl.constexpr,
  MASK_ST: tl.constexpr,
  MASK_SS: tl.constexpr,
  HAS_DBIAS: tl.constexpr,
  DOT_PRECISION: tl.constexpr,
  MASKED: tl.constexpr,
  BLOCK_M: tl.constexpr,
  BLOCK_H: tl.constexpr,
  BLOCK_HV: tl.constexpr,
):
  """Accumulates dK and dV (transposed tiles [BLOCK_N, BLOCK_M]) over query rows [lo, hi)."""
  offs_d = tl.arange(0, BLOCK_H)
  offs_dv = tl.arange(0, BLOCK_HV)
  for start_m in range(lo, hi, BLOCK_M):
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _load_tile(
      q_base + offs_m[:, None] * (N * H) + offs_d[None, :],
      offs_m,
      offs_d,
      T,
      H,
      MASKED,
      BLOCK_H != H,
    )
    if MASKED:
      lse = tl.load(lse_base + offs_m, mask=offs_m < T, other=float("inf"))
      delta = tl.load(delta_base + offs_m, mask=offs_m < T, other=0.0)
    else:
      lse = tl.load(lse_base + offs_m)
      delta = tl.load(delta_base + offs_m)
    qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
    s2_t, th_t = _scores(
      qk_t,
      bias_base,
      mask_base,
      offs_m[None, :],
      offs_n[:, None],
      kv_len,
      T,
      S,
      SCALE,
      SOFT_CAP,
      CAUSAL,
      LEFT,
      RIGHT,
      HAS_BIAS,
      BIAS_ST,
      BIAS_SS,
      HAS_MASK,
      MASK_ST,
      MASK_SS,
      MASKED,
    )
    p_t = tl.exp2(s2_t - lse[None, :])
    do = _load_tile(
      do_base + offs_m[:, None] * (N * HV) + offs_dv[None, :],
      offs_m,
      offs_dv,
      T,
      HV,
      MASKED,
      BLOCK_HV != HV,
    )
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    if SOFT_CAP > 0.0:
      ds_t = ds_t * (1.0 - th_t * th_t)
    if HAS_DBIAS:
      db_ptrs = dbias_base + offs_m[None, :].to(tl.int64) * S + offs_n[:, None]
      tl.store(db_ptrs, ds_t, mask=(offs_m[None, :] < T) & (offs_n[:, None] < S))
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
  return dk, dv


@triton.jit
def _zero_dbias(
  dbias_base, offs_n, start, end, S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
  """Writes zeros to dbias rows [start, end) of the key block `offs_n` (rows no loop visits)."""
  zeros = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
  for start_m in range(start, end, BLOCK_M):
    offs_m = start_m + tl.arange(0, BLOCK_M)
    ptrs = dbias_base + offs_m[None, :].to(tl.int64) * S + offs_n[:, None]
    tl.store(ptrs, zeros, mask=(offs_m[None, :] < end) & (offs_n[:, None] < S))


@triton.jit
def dkdv_kernel(
  q_ptr,
  k_ptr,
  v_ptr,
  bias_ptr,
  mask_ptr,
  q_len_ptr,
  kv_len_ptr,
  do_ptr,
  lse_ptr,
  delta_ptr,
  dk_ptr,
  dv_ptr,
  dbias_ptr,
  T: tl.constexpr,
  S: tl.constexpr,
  N: tl.constexpr,
  KH: tl.constexpr,
  H: tl.constexpr,
  HV: tl.constexpr,
  SCALE: tl.constexpr,
  SOFT_CAP: tl.constexpr,
  CAUSAL: tl.constexpr,
  LEFT: tl.constexpr,
  RIGHT: tl.constexpr,
  HAS_BIAS: tl.constexpr,
  BIAS_SB: tl.constexpr,
  BIAS_SN: tl.constexpr,
  BIAS_ST: tl.constexpr,
  BIAS_SS: tl.constexpr,
  HAS_MASK: tl.constexpr,
  MASK_SB: tl.constexpr,
  MASK_SN: tl.constexpr,
  MASK_ST: tl.constexpr,
  MASK_SS: tl.constexpr,
  HAS_Q_LEN: tl.constexpr,
  HAS_KV_LEN: tl.constexpr,
  HAS_DBIAS: tl.constexpr,
  DOT_PRECISION: tl.constexpr,
  BLOCK_M: tl.constexpr,
  BLOCK_N: tl.constexpr,
  BLOCK_H: tl.constexpr,
  BLOCK_HV: tl.constexpr,
):
  """One program per (key block, key/value head, batch); loops over the head's query group.

  dK and dV accumulate in registers over every query head that shares the key
  head, so the result is deterministic. With `HAS_DBIAS`, writes the logits'
  gradient to every element of dbias [B,N,T,S] (the bias dtype), zeros where no
  query row sees the key.
  """
  NUM_N: tl.constexpr = (S + BLOCK_N - 1) // BLOCK_N
  G: tl.constexpr = N // KH
  pid = tl.program_id(0)
  n_blk = pid % NUM_N
  bk = pid // NUM_N
  kh = bk % KH
  b = bk // KH
  n0 = n_blk * BLOCK_N
  b64 = b.to(tl.int64)
  q_len, kv_len = _sequence_lengths(q_len_ptr, kv_len_ptr, b, T, S, HAS_Q_LEN, HAS_KV_LEN)

  offs_n = n0 + tl.arange(0, BLOCK_N)
  offs_d = tl.arange(0, BLOCK_H)
  offs_dv = tl.arange(0, BLOCK_HV)
  k_ptrs = k_ptr + b64 * (S * KH * H) + kh * H + offs_n[:, None] * (KH * H) + offs_d[None, :]
  v_ptrs = v_ptr + b64 * (S * KH * HV) + kh * HV + offs_n[:, None] * (KH * HV) + offs_dv[None, :]
  k = _load_tile(k_ptrs, offs_n, offs_d, S, H, True, BLOCK_H != H)
  v = _load_tile(v_ptrs, offs_n, offs_dv, S, HV, True, BLOCK_HV != HV)
  dk = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
  dv = tl.zeros([BLOCK_N, BLOCK_HV], dtype=tl.float32)
  lo, full_lo, full_hi, hi = _query_range(
    n0, q_len, kv_len, T, BLOCK_M, BLOCK_N, CAUSAL, LEFT, RIGHT
  )
  ranges = ((lo, full_lo, True), (full_lo, full_hi, False), (full_hi, hi, True))
  for g in range(G):
    n = kh * G + g
    q_base = q_ptr + b64 * (T * N * H) + n * H
    do_base = do_ptr + b64 * (T * N * HV) + n * HV
    lse_base = lse_ptr + (b64 * N + n) * T
    delta_base = delta_ptr + (b64 * N + n) * T
    bias_base = bias_ptr + b64 * BIAS_SB + n.to(tl.int64) * BIAS_SN
    mask_base = mask_ptr + b64 * MASK_SB + n.to(tl.int64) * MASK_SN
    dbias_base = dbias_ptr + (b64 * N + n) * (T * S)
    if HAS_DBIAS:
      # Rows before the first visited one, which can lie past T (key blocks past the
      # last query row under a causal mask or right window).
      _zero_dbias(dbias_base, offs_n, 0, tl.minimum(lo, T), S, BLOCK_M, BLOCK_N)
      _zero_dbias(dbias_base, offs_n, hi, T, S, BLOCK_M, BLOCK_N)
    for i in tl.static_range(3):
      dk, dv = _dkdv_loop(
        dk,
        dv,
        k,
        v,
        q_base,
        do_base,
        lse_base,
        delta_base,
        bias_base,
        mask_base,
        dbias_base,
        offs_n,
        kv_len,
        ranges[i][0],
        ranges[i][1],
        T,
        S,
        N,
        H,
        HV,
        SCALE,
        SOFT_CAP,
        CAUSAL,
        LEFT,
        RIGHT,
        HAS_BIAS,
        BIAS_ST,
        BIAS_SS,
        HAS_MASK,
        MASK_ST,
        MASK_SS,
        HAS_DBIAS,
        DOT_PRECISION,
        ranges[i][2],
        BLOCK_M,
        BLOCK_H,
        BLOCK_HV,
      )
  dk = dk * SCALE
  dk_ptrs = dk_ptr + b64 * (S * KH * H) + kh * H + offs_n[:, None] * (KH * H) + offs_d[None, :]
  dv_ptrs = dv_ptr + b64 * (S * KH * HV) + kh * HV + offs_n[:, None] * (KH * HV) + offs_dv[None, :]
  tl.store(
    dk_ptrs, dk.to(dk_ptr.dtype.element_ty), mask=(offs_n[:, None] < S) & (offs_d[None, :] < H)
  )
  tl.store(
    dv_ptrs, dv.to(dv_ptr.dtype.element_ty), mask=(offs_n[:, None] < S) & (offs_dv[None, :] < HV)
  )


@triton.jit
def _dq_loop(
  dq,
  q,
  do,
  lse,
  delta,
  k_base,
  v_base,
  bias_base,
  mask_base,
  offs_m,
  kv_len,
  lo,
  hi,
  T: tl.constexpr,
  S: tl.constexpr,
  KH: tl.constexpr,
  H: tl.constexpr,
  HV: tl.constexpr,
  SCALE: tl.constexpr,
  SOFT_CAP: tl.constexpr,
  CAUSAL: tl.constexpr,
  LEFT: tl.constexpr,
  RIGHT: tl.constexpr,
  HAS_BIAS: tl.constexpr,
  BIAS_ST: tl.constexpr,
  BIAS_SS: tl.constexpr,
  HAS_MASK: tl.constexpr,
  MASK_ST: tl.constexpr,
  MASK_SS: tl.constexpr,
  DOT_PRECISION: tl.constexpr,
  MASKED: tl.constexpr,
  BLOCK_N: tl.constexpr,
  BLOCK_H: tl.constexpr,
  BLOCK_HV: tl.constexpr,
):
  """Accumulates dQ over key rows [lo, hi)."""
  offs_d = tl.arange(0, BLOCK_H)
  offs_dv = tl.arange(0, BLOCK_HV)
  for start_n in range(lo, hi, BLOCK_N):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load_tile(
      k_base + offs_n[:, None] * (KH * H) + offs_d[None, :],
      offs_n,
      offs_d,
      S,
      H,
      MASKED,
      BLOCK_H != H,
    )
    v = _load_tile(
      v_base + offs_n[:, None] * (KH * HV) + offs_dv[None, :],
      offs_n,
      offs_dv,
      S,
      HV,
      MASKED,
      BLOCK_HV != HV,
    )
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    s2, th = _scores(
      qk,
      bias_base,
      mask_base,
      offs_m[:, None],
      offs_n[None, :],
      kv_len,
      T,
      S,
      SCALE,
      SOFT_CAP,
      CAUSAL,
      LEFT,
      RIGHT,
      HAS_BIAS,
      BIAS_ST,
      BIAS_SS,
      HAS_MASK,
      MASK_ST,
      MASK_SS,
      MASKED,
    )
    p = tl.exp2(s2 - lse[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    if SOFT_CAP > 0.0:
      ds = ds * (1.0 - th * th)
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
  return dq


@triton.jit
def dq_kernel(
  q_ptr,
  k_ptr,
  v_ptr,
  bias_ptr,
  mask_ptr,
  q_len_ptr,
  kv_len_ptr,
  do_ptr,
  lse_ptr,
  delta_ptr,
  dq_ptr,
  T: tl.constexpr,
  S: tl.constexpr,
  N: tl.constexpr,
  KH: tl.constexpr,
  H: tl.constexpr,
  HV: tl.constexpr,
  SCALE: tl.constexpr,
  SOFT_CAP: tl.constexpr,
  CAUSAL: tl.constexpr,
  LEFT: tl.constexpr,
  RIGHT: tl.constexpr,
  HAS_BIAS: tl.constexpr,
  BIAS_SB: tl.constexpr,
  BIAS_SN: tl.constexpr,
  BIAS_ST: tl.constexpr,
  BIAS_SS: tl.constexpr,
  HAS_MASK: tl.constexpr,
  MASK_SB: tl.constexpr,
  MASK_SN: tl.constexpr,
  MASK_ST: tl.constexpr,
  MASK_SS: tl.constexpr,
  HAS_Q_LEN: tl.constexpr,
  HAS_KV_LEN: tl.constexpr,
  DOT_PRECISION: tl.constexpr,
  BLOCK_M: tl.constexpr,
  BLOCK_N: tl.constexpr,
  BLOCK_H: tl.constexpr,
  BLOCK_HV: tl.constexpr,
):
  """One program per (query block, head, batch), as the forward pass."""
  b64, n, kh, m0, q_len, kv_len = _query_block(
    q_len_ptr, kv_len_ptr, T, S, N, KH, CAUSAL, HAS_Q_LEN, HAS_KV_LEN, BLOCK_M
  )

  offs_m = m0 + tl.arange(0, BLOCK_M)
  offs_d = tl.arange(0, BLOCK_H)
  offs_dv = tl.arange(0, BLOCK_HV)
  q_off = b64 * (T * N * H) + n * H + offs_m[:, None] * (N * H) + offs_d[None, :]
  q = _load_tile(q_ptr + q_off, offs_m, offs_d, T, H, True, BLOCK_H != H)
  do = _load_tile(
    do_ptr + b64 * (T * N * HV) + n * HV + offs_m[:, None] * (N * HV) + offs_dv[None, :],
    offs_m,
    offs_dv,
    T,
    HV,
    True,
    BLOCK_HV != HV,
  )
  lse = tl.load(lse_ptr + (b64 * N + n) * T + offs_m, mask=offs_m < T, other=float("inf"))
  delta = tl.load(delta_ptr + (b64 * N + n) * T + offs_m, mask=offs_m < T, other=0.0)
  k_base = k_ptr + b64 * (S * KH * H) + kh * H
  v_base = v_ptr + b64 * (S * KH * HV) + kh * HV
  bias_base = bias_ptr + b64 * BIAS_SB + n.to(tl.int64) * BIAS_SN
  mask_base = mask_ptr + b64 * MASK_SB + n.to(tl.int64) * MASK_SN

  dq = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
  lo, full_lo, full_hi, hi = _key_range(m0, q_len, kv_len, BLOCK_M, BLOCK_N, CAUSAL, LEFT, RIGHT)
  ranges = ((lo, full_lo, True), (full_lo, full_hi, False), (full_hi, hi, True))
  for i in tl.static_range(3):
    dq = _dq_loop(
      dq,
      q,
      do,
      lse,
      delta,
      k_base,
      v_base,
      bias_base,
      mask_base,
      offs_m,
      kv_len,
      ranges[i][0],
      ranges[i][1],
      T,
      S,
      KH,
      H,
      HV,
      SCALE,
      SOFT_CAP,
      CAUSAL,
      LEFT,
      RIGHT,
      HAS_BIAS,
      BIAS_ST,
      BIAS_SS,
      HAS_MASK,
      MASK_ST,
      MASK_SS,
      DOT_PRECISION,
      ranges[i][2],
      BLOCK_N,
      BLOCK_H,
      BLOCK_HV,
    )
  dq = dq * SCALE
  tl.store(
    dq_ptr + q_off,
    dq.to(dq_ptr.dtype.element_ty),
    mask=(offs_m[:, None] < T) & (offs_d[None, :] < H),
  )
