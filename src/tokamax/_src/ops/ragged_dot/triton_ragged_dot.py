"""Triton kernels of the grouped matmul over contiguous row groups.

`ragged_rows` computes the "default" and "rhs_transposed" layouts: the output
rows are cut into tiles that never straddle two groups (the wrapper computes
the schedule: per tile its group, first row and end row); a tile of group -1
writes zeros (rows in no group), a tile of group -2 does nothing (the grid is
sized for the worst case). The rhs strides are constexprs, so one kernel
serves both layouts.

`ragged_contracting` computes out[g] = lhs[rows of g].T @ rhs[rows of g]: one
program per output tile of one group, looping over the group's rows.
"""

import triton
import triton.language as tl


@triton.jit
def ragged_rows(
  lhs_ptr,
  rhs_ptr,
  schedule_ptr,
  out_ptr,
  K: tl.constexpr,
  N: tl.constexpr,
  NUM_TILES: tl.constexpr,
  RHS_STRIDE_G: tl.constexpr,
  RHS_STRIDE_K: tl.constexpr,
  RHS_STRIDE_N: tl.constexpr,
  BLOCK_M: tl.constexpr,
  BLOCK_N: tl.constexpr,
  BLOCK_K: tl.constexpr,
  INPUT_PRECISION: tl.constexpr,
):
  pid = tl.program_id(0)
  tiles_n: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
  tile = pid // tiles_n
  pid_n = pid % tiles_n
  group = tl.load(schedule_ptr + tile)
  if group == -2:
    return
  row0 = tl.load(schedule_ptr + NUM_TILES + tile)
  row1 = tl.load(schedule_ptr + 2 * NUM_TILES + tile)
  rows = row0 + tl.arange(0, BLOCK_M)
  row_ok = rows < row1
  cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
  col_ok = cols < N
  acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
  if group >= 0:
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = lhs_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]
    b_ptrs = (
      rhs_ptr
      + group.to(tl.int64) * RHS_STRIDE_G
      + ks[:, None] * RHS_STRIDE_K
      + cols[None, :] * RHS_STRIDE_N
    )
    for k in range(0, K, BLOCK_K):
      if K % BLOCK_K == 0:
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
      else:
        k_ok = ks + k < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
      acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
      a_ptrs += BLOCK_K
      b_ptrs += BLOCK_K * RHS_STRIDE_K
  out_ptrs = out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
  tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def ragged_contracting(
  lhs_ptr,
  rhs_ptr,
  bounds_ptr,
  out_ptr,
  K: tl.constexpr,
  N: tl.constexpr,
  G: tl.constexpr,
  BLOCK_M: tl.constexpr,
  BLOCK_K: tl.constexpr,
  BLOCK_N: tl.constexpr,
  INPUT_PRECISION: tl.constexpr,
):
  pid = tl.program_id(0)
  tiles_k: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
  tiles_n: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
  group = pid // (tiles_k * tiles_n)
  rest = pid % (tiles_k * tiles_n)
  pid_k = rest // tiles_n
  pid_n = rest % tiles_n
  start = tl.load(bounds_ptr + group)
  end = tl.load(bounds_ptr + G + group)
  ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
  ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
  k_ok = ks < K
  n_ok = ns < N
  acc = tl.zeros((BLOCK_K, BLOCK_N), tl.float32)
  for r in range(start, end, BLOCK_M):
    rows = r + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    a = tl.load(
      lhs_ptr + rows[None, :].to(tl.int64) * K + ks[:, None],
      mask=k_ok[:, None] & row_ok[None, :],
      other=0.0,
    )
    b = tl.load(
      rhs_ptr + rows[:, None].to(tl.int64) * N + ns[None, :],
      mask=row_ok[:, None] & n_ok[None, :],
      other=0.0,
    )
    acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
  out_ptrs = out_ptr + group.to(tl.int64) * K * N + ks[:, None] * N + ns[None, :]
  tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=k_ok[:, None] & n_ok[None, :])
