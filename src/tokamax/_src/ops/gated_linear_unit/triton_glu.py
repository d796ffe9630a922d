"""Triton kernel of the fused gated linear unit.

One program computes a BLOCK_M x BLOCK_N tile of both projections from the
same x tile (x is read once per K step), then applies the gate in the
epilogue. With SAVE the pre-activation projections are written too, as the
residuals of the backward pass. Programs are ordered in groups of GROUP_M row
tiles so that neighbours share weight columns in L2.
"""

import triton
import triton.language as tl


@triton.jit
def _activate(g, ACTIVATION: tl.constexpr):
  if ACTIVATION == "silu":
    return g * tl.sigmoid(g)
  elif ACTIVATION == "sigmoid":
    return tl.sigmoid(g)
  elif ACTIVATION == "relu":
    return tl.maximum(g, 0.0)
  elif ACTIVATION == "leaky_relu":  # jax.nn.leaky_relu's default slope.
    return tl.where(g >= 0.0, g, 0.01 * g)
  elif ACTIVATION == "tanh":
    return 2.0 * tl.sigmoid(2.0 * g) - 1.0
  elif ACTIVATION == "gelu_tanh":
    inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    return g * tl.sigmoid(2.0 * inner)  # 0.5 * g * (1 + tanh(inner))
  else:
    return g


@triton.jit
def glu_fwd(
  x_ptr,
  wg_ptr,
  wu_ptr,
  out_ptr,
  gate_ptr,
  up_ptr,
  M: tl.constexpr,
  K: tl.constexpr,
  N: tl.constexpr,
  W_STRIDE: tl.constexpr,
  UP_OFFSET: tl.constexpr,
  ACTIVATION: tl.constexpr,
  SAVE: tl.constexpr,
  BLOCK_M: tl.constexpr,
  BLOCK_N: tl.constexpr,
  BLOCK_K: tl.constexpr,
  GROUP_M: tl.constexpr,
  INPUT_PRECISION: tl.constexpr,
):
  pid = tl.program_id(0)
  tiles_m: tl.constexpr = (M + BLOCK_M - 1) // BLOCK_M
  tiles_n: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
  per_group = GROUP_M * tiles_n
  first_m = (pid // per_group) * GROUP_M
  group_m = tl.minimum(tiles_m - first_m, GROUP_M)
  pid_m = first_m + (pid % per_group) % group_m
  pid_n = (pid % per_group) // group_m
  rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
  row_ok = rows < M
  ks = tl.arange(0, BLOCK_K)
  # Both projections as one [BLOCK_K, 2 * BLOCK_N] operand: gate columns, then up
  # columns, so that a single dot (one accumulator chain) computes both.
  c = tl.arange(0, 2 * BLOCK_N)
  cols2 = pid_n * BLOCK_N + c % BLOCK_N
  is_up = c >= BLOCK_N
  col2_ok = cols2 < N
  x_ptrs = x_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]
  w_ptrs = (
    tl.where(is_up, wu_ptr + UP_OFFSET, wg_ptr)[None, :] + ks[:, None] * W_STRIDE + cols2[None, :]
  )
  acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), tl.float32)
  for k in range(0, K, BLOCK_K):
    if K % BLOCK_K == 0:
      a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
      b = tl.load(w_ptrs, mask=col2_ok[None, :], other=0.0)
    else:
      k_ok = ks + k < K
      a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
      b = tl.load(w_ptrs, mask=k_ok[:, None] & col2_ok[None, :], other=0.0)
    acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    x_ptrs += BLOCK_K
    w_ptrs += BLOCK_K * W_STRIDE
  gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
  cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
  mask = row_ok[:, None] & (cols[None, :] < N)
  offs = rows[:, None].to(tl.int64) * N + cols[None, :]
  out = _activate(gate, ACTIVATION) * up
  tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)
  if SAVE:
    tl.store(gate_ptr + offs, gate.to(gate_ptr.dtype.element_ty), mask=mask)
    tl.store(up_ptr + offs, up.to(up_ptr.dtype.element_ty), mask=mask)
