"""Triton kernels of LayerNorm/RMSNorm over the last axis of a [M, D] array.

Each program normalises BLOCK_M whole rows held in registers (BLOCK_D >= D).
Statistics are float32. The backward kernel walks a contiguous run of rows per
program (runs differ by at most one row block) and writes per-program partial
sums of dscale and doffset, which `sum_partials` adds up in a fixed order
(deterministic), column block by column block.

Row loops either keep the next rows' loads in registers (`PREFETCH`) or, with
`STAGES` > 1, let Triton's software pipeliner copy the next `STAGES - 1` row
blocks into shared memory (cp.async) while the current one is normalised: the
bytes in flight then cost no registers, which wide rows (D >= 8192) lack.
"""

import triton
import triton.language as tl

# No cache hint (the default of `tl.load` and `tl.store`). Defaults of jit parameters
# take it as a constexpr: a plain str default does not reach `tl.load` as one.
_NO_HINT = tl.constexpr("")


@triton.jit
def _add_pairs(a0, a1, b0, b1):
  return a0 + b0, a1 + b1


@triton.jit
def _row_stats(
  x, mask, shift, D: tl.constexpr, SUBTRACT_MEAN: tl.constexpr, ONE_PASS: tl.constexpr
):
  """(mean, variance) of each row of float32 `x` [BLOCK_M, BLOCK_D] (masked entries zero).

  ONE_PASS reduces the sums of x - shift and of its squares together (one
  round of cross-warp reduction instead of two); `shift`, an element of each
  row, keeps E[d^2] - E[d]^2 from cancelling when the mean is far from zero.
  """
  if SUBTRACT_MEAN:
    if ONE_PASS:
      d = tl.where(mask, x - shift[:, None], 0.0)
      s1, s2 = tl.reduce((d, d * d), 1, _add_pairs)
      mean_d = s1 / D
      return shift + mean_d, tl.maximum(s2 / D - mean_d * mean_d, 0.0)
    mean = tl.sum(x, axis=1) / D
    xc = tl.where(mask, x - mean[:, None], 0.0)
    return mean, tl.sum(xc * xc, axis=1) / D
  return tl.zeros((x.shape[0],), tl.float32), tl.sum(x * x, axis=1) / D


@triton.jit
def _row_shift(x_ptr, rows, row_ok, D: tl.constexpr, NEEDED: tl.constexpr):
  """Each row's first element (float32), or zeros where not NEEDED."""
  if NEEDED:
    return tl.load(x_ptr + rows.to(tl.int64) * D, mask=row_ok, other=0.0).to(tl.float32)
  return tl.zeros(rows.shape, tl.float32)


@triton.jit
def layer_norm_fwd(
  x_ptr,
  scale_ptr,
  offset_ptr,
  m,
  y_ptr,
  mean_ptr,
  rstd_ptr,
  D: tl.constexpr,
  BLOCK_M: tl.constexpr,
  BLOCK_D: tl.constexpr,
  EPS: tl.constexpr,
  SCALE_OFFSET: tl.constexpr,
  HAS_SCALE: tl.constexpr,
  HAS_OFFSET: tl.constexpr,
  SUBTRACT_MEAN: tl.constexpr,
  ONE_PASS: tl.constexpr = False,
  EVICT: tl.constexpr = _NO_HINT,
  STORE: tl.constexpr = _NO_HINT,
):
  rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
  cols = tl.arange(0, BLOCK_D)
  row_ok = rows < m
  col_ok = cols < D
  mask = row_ok[:, None] & col_ok[None, :]
  offs = rows[:, None].to(tl.int64) * D + cols[None, :]
  x = tl.load(x_ptr + offs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
  shift = _row_shift(x_ptr, rows, row_ok, D, SUBTRACT_MEAN and ONE_PASS)
  mean, var = _row_stats(x, mask, shift, D, SUBTRACT_MEAN, ONE_PASS)
  rstd = 1.0 / tl.sqrt(var + EPS)
  y = (x - mean[:, None]) * rstd[:, None]
  if HAS_SCALE:
    w = tl.load(scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) + SCALE_OFFSET
    y = y * w[None, :]
  elif SCALE_OFFSET != 0.0:
    y = y * (1.0 + SCALE_OFFSET)
  if HAS_OFFSET:
    b = tl.load(offset_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = y + b[None, :]
  tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask, cache_modifier=STORE)
  tl.store(mean_ptr + rows, mean, mask=row_ok)
  tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _load_rows(
  ptr,
  start,
  last,
  cols,
  col_ok,
  D: tl.constexpr,
  BLOCK_M: tl.constexpr,
  EVICT: tl.constexpr = _NO_HINT,
):
  """BLOCK_M rows of a [*, D] array from row `start`; rows from `last` on read as zeros."""
  rows = start + tl.arange(0, BLOCK_M)
  mask = (rows < last)[:, None] & col_ok[None, :]
  offs = rows[:, None].to(tl.int64) * D + cols[None, :]
  return tl.load(ptr + offs, mask=mask, other=0.0, eviction_policy=EVICT)


@triton.jit
def _bwd_rows(
  x_raw,
  dy_raw,
  w,
  start,
  last,
  cols,
  col_ok,
  mean_ptr,
  rstd_ptr,
  dx_ptr,
  D: tl.constexpr,
  BLOCK_M: tl.constexpr,
  SUBTRACT_MEAN: tl.constexpr,
):
  """dx of BLOCK_M rows from `start`; returns their dscale and doffset sums."""
  rows = start + tl.arange(0, BLOCK_M)
  row_ok = rows < last
  mask = row_ok[:, None] & col_ok[None, :]
  offs = rows[:, None].to(tl.int64) * D + cols[None, :]
  x = x_raw.to(tl.float32)
  dy = dy_raw.to(tl.float32)
  rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
  if SUBTRACT_MEAN:
    mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
    xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
  else:
    xhat = x * rstd[:, None]
  wdy = dy * w[None, :]
  c1 = tl.sum(xhat * wdy, axis=1) / D
  if SUBTRACT_MEAN:
    c2 = tl.sum(wdy, axis=1) / D
    dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
  else:
    dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
  tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
  return tl.sum(dy * xhat, axis=0), tl.sum(dy, axis=0)


@triton.jit
def layer_norm_bwd(
  x_ptr,
  scale_ptr,
  dy_ptr,
  mean_ptr,
  rstd_ptr,
  m,
  dx_ptr,
  dscale_ptr,
  doffset_ptr,
  D: tl.constexpr,
  BLOCK_M: tl.constexpr,
  BLOCK_D: tl.constexpr,
  SCALE_OFFSET: tl.constexpr,
  HAS_SCALE: tl.constexpr,
  SUBTRACT_MEAN: tl.constexpr,
  HAS_OFFSET: tl.constexpr = True,
  PREFETCH: tl.constexpr = False,
  STAGES: tl.constexpr = 0,
):
  pid = tl.program_id(0)
  cols = tl.arange(0, BLOCK_D)
  col_ok = cols < D
  if HAS_SCALE:
    w = tl.load(scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) + SCALE_OFFSET
  else:
    w = tl.full((BLOCK_D,), 1.0 + SCALE_OFFSET, tl.float32)
  dscale = tl.zeros((BLOCK_D,), tl.float32)
  doffset = tl.zeros((BLOCK_D,), tl.float32)
  # Row blocks shared out evenly: the first `extra` programs take one more.
  blocks = tl.cdiv(m, BLOCK_M)
  per_program = blocks // tl.num_programs(0)
  extra = blocks % tl.num_programs(0)
  first = (pid * per_program + tl.minimum(pid, extra)) * BLOCK_M
  last = tl.minimum(first + (per_program + (pid < extra)) * BLOCK_M, m)
  if PREFETCH:
    # The next rows' loads are issued before this step's reductions and stores.
    x_next = _load_rows(x_ptr, first, last, cols, col_ok, D, BLOCK_M)
    dy_next = _load_rows(dy_ptr, first, last, cols, col_ok, D, BLOCK_M)
    for start in range(first, last, BLOCK_M):
      x_raw, dy_raw = x_next, dy_next
      x_next = _load_rows(x_ptr, start + BLOCK_M, last, cols, col_ok, D, BLOCK_M)
      dy_next = _load_rows(dy_ptr, start + BLOCK_M, last, cols, col_ok, D, BLOCK_M)
      ds, do = _bwd_rows(
        x_raw,
        dy_raw,
        w,
        start,
        last,
        cols,
        col_ok,
        mean_ptr,
        rstd_ptr,
        dx_ptr,
        D,
        BLOCK_M,
        SUBTRACT_MEAN,
      )
      dscale += ds
      if HAS_OFFSET:
        doffset += do
  else:
    # STAGES > 1: software-pipelined through shared memory (no register
    # prefetch); else a plain loop (`num_stages=None` adds no pipelining hint).
    for start in tl.range(first, last, BLOCK_M, num_stages=STAGES if STAGES > 1 else None):
      x_raw = _load_rows(x_ptr, start, last, cols, col_ok, D, BLOCK_M)
      dy_raw = _load_rows(dy_ptr, start, last, cols, col_ok, D, BLOCK_M)
      ds, do = _bwd_rows(
        x_raw,
        dy_raw,
        w,
        start,
        last,
        cols,
        col_ok,
        mean_ptr,
        rstd_ptr,
        dx_ptr,
        D,
        BLOCK_M,
        SUBTRACT_MEAN,
      )
      dscale += ds
      if HAS_OFFSET:
        doffset += do
  if HAS_SCALE:
    tl.store(dscale_ptr + pid * D + cols, dscale, mask=col_ok)
  if HAS_OFFSET:
    tl.store(doffset_ptr + pid * D + cols, doffset, mask=col_ok)


@triton.jit
def sum_partials(
  dscale_partials_ptr,
  doffset_partials_ptr,
  programs,
  dscale_ptr,
  doffset_ptr,
  D: tl.constexpr,
  BLOCK_P: tl.constexpr,
  BLOCK_C: tl.constexpr,
  HAS_SCALE: tl.constexpr,
  HAS_OFFSET: tl.constexpr,
):
  """dscale and doffset: the [programs, D] partial sums added over programs.

  Both vectors' loads of a block are issued before either sum (one round of
  latency per block, not two: 3.1-3.8 against 5.6-9.7 us on the H200).
  """
  cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
  col_ok = cols < D
  dscale = tl.zeros((BLOCK_C,), tl.float32)
  doffset = tl.zeros((BLOCK_C,), tl.float32)
  for start in range(0, programs, BLOCK_P):
    if HAS_SCALE:
      s = _load_rows(dscale_partials_ptr, start, programs, cols, col_ok, D, BLOCK_P)
    if HAS_OFFSET:
      o = _load_rows(doffset_partials_ptr, start, programs, cols, col_ok, D, BLOCK_P)
    if HAS_SCALE:
      dscale += tl.sum(s, axis=0)
    if HAS_OFFSET:
      doffset += tl.sum(o, axis=0)
  if HAS_SCALE:
    tl.store(dscale_ptr + cols, dscale.to(dscale_ptr.dtype.element_ty), mask=col_ok)
  if HAS_OFFSET:
    tl.store(doffset_ptr + cols, doffset.to(doffset_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _fwd_rows(
  x_ptr,
  x_raw,
  w,
  b,
  start,
  m,
  cols,
  col_ok,
  y_ptr,
  mean_ptr,
  rstd_ptr,
  D: tl.constexpr,
  BLOCK_M: tl.constexpr,
  EPS: tl.constexpr,
  SUBTRACT_MEAN: tl.constexpr,
  ONE_PASS: tl.constexpr,
  STORE: tl.constexpr,
):
  """Normalises BLOCK_M loaded rows from `start`; stores y, mean and rstd."""
  rows = start + tl.arange(0, BLOCK_M)
  row_ok = rows < m
  mask = row_ok[:, None] & col_ok[None, :]
  x = x_raw.to(tl.float32)
  shift = _row_shift(x_ptr, rows, row_ok, D, SUBTRACT_MEAN and ONE_PASS)
  mean, var = _row_stats(x, mask, shift, D, SUBTRACT_MEAN, ONE_PASS)
  rstd = 1.0 / tl.sqrt(var + EPS)
  y = (x - mean[:, None]) * rstd[:, None] * w[None, :] + b[None, :]
  offs = rows[:, None].to(tl.int64) * D + cols[None, :]
  tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask, cache_modifier=STORE)
  tl.store(mean_ptr + rows, mean, mask=row_ok)
  tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def layer_norm_fwd_persistent(
  x_ptr,
  scale_ptr,
  offset_ptr,
  m,
  y_ptr,
  mean_ptr,
  rstd_ptr,
  D: tl.constexpr,
  BLOCK_M: tl.constexpr,
  BLOCK_D: tl.constexpr,
  EPS: tl.constexpr,
  SCALE_OFFSET: tl.constexpr,
  HAS_SCALE: tl.constexpr,
  HAS_OFFSET: tl.constexpr,
  SUBTRACT_MEAN: tl.constexpr,
  STAGES: tl.constexpr = 0,
  ONE_PASS: tl.constexpr = False,
  EVICT: tl.constexpr = _NO_HINT,
  STORE: tl.constexpr = _NO_HINT,
):
  """Programs stride over row blocks, loading ahead of this block's math.

  With STAGES > 1 the next STAGES - 1 blocks are copied into shared memory by
  Triton's pipeliner; otherwise the next block is held in registers.
  """
  pid = tl.program_id(0)
  programs = tl.num_programs(0)
  cols = tl.arange(0, BLOCK_D)
  col_ok = cols < D
  if HAS_SCALE:
    w = tl.load(scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) + SCALE_OFFSET
  else:
    w = tl.full((BLOCK_D,), 1.0 + SCALE_OFFSET, tl.float32)
  if HAS_OFFSET:
    b = tl.load(offset_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
  else:
    b = tl.zeros((BLOCK_D,), tl.float32)
  step = programs * BLOCK_M
  if STAGES > 1:
    for start in tl.range(pid * BLOCK_M, m, step, num_stages=STAGES):
      x_raw = _load_rows(x_ptr, start, m, cols, col_ok, D, BLOCK_M, EVICT)
      _fwd_rows(
        x_ptr,
        x_raw,
        w,
        b,
        start,
        m,
        cols,
        col_ok,
        y_ptr,
        mean_ptr,
        rstd_ptr,
        D,
        BLOCK_M,
        EPS,
        SUBTRACT_MEAN,
        ONE_PASS,
        STORE,
      )
  else:
    x_next = _load_rows(x_ptr, pid * BLOCK_M, m, cols, col_ok, D, BLOCK_M, EVICT)
    for start in range(pid * BLOCK_M, m, step):
      x_raw = x_next
      x_next = _load_rows(x_ptr, start + step, m, cols, col_ok, D, BLOCK_M, EVICT)
      _fwd_rows(
        x_ptr,
        x_raw,
        w,
        b,
        start,
        m,
        cols,
        col_ok,
        y_ptr,
        mean_ptr,
        rstd_ptr,
        D,
        BLOCK_M,
        EPS,
        SUBTRACT_MEAN,
        ONE_PASS,
        STORE,
      )
