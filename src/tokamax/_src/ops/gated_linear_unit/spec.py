"""The gated_linear_unit op: activation(x @ w_gate) * (x @ w_up)."""

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from tokamax._src import arguments, validation
from tokamax._src.ops import op
from tokamax._src.ops import partitioning as partitioning_lib


@arguments.op_arguments
class GluArgs:
  """Canonical arguments; `weights` is fused [K,2,N] (gate first) or (w_gate, w_up)."""

  x: Float[Array, "*B M K"]
  weights: Float[Array, "K 2 N"] | tuple[Float[Array, "K N"], Float[Array, "K N"]]
  activation: Callable[[jax.Array], jax.Array] | None = arguments.static()
  precision: object = arguments.static()

  def gate_and_up_weights(self) -> tuple[jax.Array, jax.Array]:
    if isinstance(self.weights, tuple):
      return self.weights
    return self.weights[:, 0], self.weights[:, 1]

  @property
  def n(self) -> int:
    # From shapes alone, so that abstract records (ShapeDtypeStructs) work too.
    return (self.weights[0] if isinstance(self.weights, tuple) else self.weights).shape[-1]


def canonicalize(x, weights, *, activation=None, precision=None) -> GluArgs:
  x = validation.floating("x", x)
  validation.min_rank("x", x, 2, "x [*B, M, K]")
  k = x.shape[-1]
  if isinstance(weights, tuple | list):
    if len(weights) != 2:
      raise ValueError(
        f"`weights` as a sequence must be (w_gate, w_up), got {len(weights)} arrays."
      )
    weights = tuple(validation.floating(f"weights[{i}]", w) for i, w in enumerate(weights))
    for i, w in enumerate(weights):
      if w.ndim != 2 or w.shape[0] != k:
        raise ValueError(f"`weights[{i}]` must have shape [K={k}, N], got {w.shape}.")
    if weights[0].shape != weights[1].shape:
      raise ValueError(f"`w_gate` {weights[0].shape} and `w_up` {weights[1].shape} must match.")
  else:
    weights = validation.floating("weights", weights)
    if weights.ndim != 3 or weights.shape[0] != k or weights.shape[1] != 2:
      raise ValueError(f"`weights` must have shape [K={k}, 2, N], got {weights.shape}.")
  if activation is not None and not callable(activation):
    raise TypeError(f"`activation` must be callable or None, got {activation!r}.")
  return GluArgs(
    x=x, weights=weights, activation=activation, precision=validation.precision(precision)
  )


def num_rows(args: GluArgs) -> int:
  """M: the rows of x (batch dims included), also where K is 0."""
  return math.prod(args.x.shape[:-1])


def cost(args: GluArgs) -> op.Cost:
  m = num_rows(args)
  k, n = args.x.shape[-1], args.n
  itemsize = np.dtype(args.x.dtype).itemsize
  return op.Cost(flops=2.0 * m * k * 2 * n, bytes=float(itemsize * (m * k + 2 * k * n + m * n)))


def partitioning(args: GluArgs) -> partitioning_lib.Rule:
  """Rows (batch dims and M) and output columns N split; K is contracted whole."""
  rows = (*(f"b{i}" for i in range(args.x.ndim - 2)), "m")
  fused = not isinstance(args.weights, tuple)
  return partitioning_lib.Rule(
    inputs={"x": (*rows, "k"), "weights": ("k", None, "n") if fused else [("k", "n")] * 2},
    output=(*rows, "n"),
    split=frozenset((*rows, "n")),
  )


# Rows up to which Triton's forward beat Mosaic's on the H200 (decode-sized calls).
TRITON_FORWARD_ROWS = 128


def reorder(args: GluArgs, platform: str, names: tuple[str, ...]) -> tuple[str, ...]:
  """Few rows: Triton's forward first on a GPU (H200, M128 K4096 N14336 bf16: 0.0603 ms against
  Mosaic's 0.0628 in three interleaved rounds, bench/results/h200/bench_run_b72b094.json; M2048
  and M8192: Mosaic, bench_run_7af72e4.json)."""
  return op.move_first("triton", names) if _few_rows_on_gpu(args, platform) else names


def gradient_preference(args: GluArgs, platform: str) -> tuple[str, ...]:
  """Where `reorder` put Triton first, the usual order (Mosaic's forward and backward) under
  differentiation (M128: 0.223 ms against Triton's 0.243, bench/results/h200/bench_run_748cea4.json)."""
  return SPEC.default_order(platform) if _few_rows_on_gpu(args, platform) else ()


def _few_rows_on_gpu(args: GluArgs, platform: str) -> bool:
  return platform == "gpu" and num_rows(args) <= TRITON_FORWARD_ROWS


SPEC = op.OpSpec(
  name="gated_linear_unit",
  canonicalize=canonicalize,
  implementations={
    "xla": "tokamax._src.ops.gated_linear_unit.xla:XlaGatedLinearUnit",
    "triton": "tokamax._src.ops.gated_linear_unit.triton:TritonGatedLinearUnit",
    "mosaic": "tokamax._src.ops.gated_linear_unit.mosaic:MosaicGatedLinearUnit",
  },
  preference={"gpu": ("mosaic", "triton")},
  reorder=reorder,
  gradient_preference=gradient_preference,
  cost=cost,
  partitioning=partitioning,
)


def _both_halves(precision, x: jax.Array, weights: jax.Array) -> jax.Array:
  """x @ [K, 2, N] weights -> [..., 2, N]."""
  return jnp.einsum("...k,kjn->...jn", x, weights, precision=precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _both_halves_split_backward(precision, x: jax.Array, weights: jax.Array) -> jax.Array:
  """`_both_halves` whose backward multiplies each half apart: on the CPU, JAX's derivative
  of the one matmul took 1.46x the forward+backward of these (SwiGLU 256x512x1024)."""
  return _both_halves(precision, x, weights)


def _split_fwd(precision, x, weights):
  return _both_halves(precision, x, weights), (x, weights)


def _split_bwd(precision, saved, d):
  x, weights = saved
  halves = [d[..., j, :] for j in range(2)]
  dx = sum(
    jnp.einsum("...n,kn->...k", dj, weights[:, j], precision=precision)
    for j, dj in enumerate(halves)
  )
  # Explicit row counts: a -1 cannot be inferred where K or N is 0.
  rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
  dw = jnp.stack(
    [jnp.matmul(rows.T, dj.reshape(len(rows), dj.shape[-1]), precision=precision) for dj in halves],
    axis=1,
  )
  # Inside shard_map: each cotangent varies as its input does, summed over the other axes.
  vma = partitioning_lib.vma
  axes = vma(x) | vma(weights) | vma(d)
  return (
    partitioning_lib.cotangent(dx, vma(x), axes).astype(x.dtype),
    partitioning_lib.cotangent(dw, vma(weights), axes).astype(weights.dtype),
  )


_both_halves_split_backward.defvjp(_split_fwd, _split_bwd)


def reference(args: GluArgs) -> jax.Array:
  """The gate and up projections (one matmul for [K, 2, N] weights) and the gate, in XLA."""
  if isinstance(args.weights, tuple):
    dot = lambda w: jnp.einsum("...k,kn->...n", args.x, w, precision=args.precision)
    gate, up = (dot(w) for w in args.weights)
  else:  # One matmul over both halves: faster than two on the H200 (0.72x at M=2048).
    both = jax.lax.platform_dependent(
      args.x,
      args.weights,
      cpu=functools.partial(_both_halves_split_backward, args.precision),
      default=functools.partial(_both_halves, args.precision),
    )
    gate, up = both[..., 0, :], both[..., 1, :]
  if args.activation is not None:
    gate = args.activation(gate)
  return (gate * up).astype(args.x.dtype)
