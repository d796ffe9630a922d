"""Example: your own op, tunable by `tokamax.autotune`.

An op is declared once by an `OpSpec` (its canonical arguments, its
implementations, which ones `implementation=None` tries); an implementation is
a frozen dataclass subclassing `tokamax.Op` whose `config_cls` holds what can
be tuned. Overriding `_get_autotuning_configs` gives the autotuner its search
space; `_get_heuristics_config` is the config used when nothing was tuned.

Here the op is row-wise root-mean-square, `rms(x)[i] = sqrt(mean(x[i] ** 2))`,
and the tunable implementation reduces the columns in blocks of
`block_cols` (a scan), so the block size changes the compiled program:

  import tokamax
  from tokamax._src.autotuning import example_user_op as ex

  f = jax.jit(jax.grad(lambda x: ex.row_rms(x, implementation="blocked").sum()))
  result = tokamax.autotune(f, x)       # Finds the op (in the gradient too), times 4 configs.
  with result:
    f(x)                                # Retraced with the fastest block size.
  result.dump("row_rms_tuning.json")    # Keep it; `AutotuningResult.load` reads it back.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from tokamax._src import arguments, validation
from tokamax._src.ops import op


@arguments.op_arguments
class RowRmsArgs:
  """Canonical arguments: `x` [M, N] (other ranks flatten to it), static `batch_shape`."""

  x: Float[Array, "M N"]
  batch_shape: tuple[int, ...] = arguments.static()


def canonicalize(x) -> RowRmsArgs:
  x = validation.floating("x", x)
  validation.min_rank("x", x, 1, "x [..., N]")
  return RowRmsArgs(x=x.reshape(-1, x.shape[-1]), batch_shape=tuple(x.shape[:-1]))


def finalize(args: RowRmsArgs, out: jax.Array) -> jax.Array:
  return out.reshape(args.batch_shape)


def reference(args: RowRmsArgs) -> jax.Array:
  x = args.x.astype(jnp.float32)
  return jnp.sqrt(jnp.mean(x * x, axis=-1)).astype(args.x.dtype)


def cost(args: RowRmsArgs) -> op.Cost:
  return op.Cost(flops=2.0 * args.x.size, bytes=float(args.x.size * args.x.dtype.itemsize))


SPEC = op.OpSpec(
  name="example_row_rms",
  canonicalize=canonicalize,
  implementations={
    "xla": "tokamax._src.autotuning.example_user_op:XlaRowRms",
    "blocked": "tokamax._src.autotuning.example_user_op:BlockedRowRms",
  },
  preference={"cpu": ("blocked",), "gpu": ("blocked",)},
  cost=cost,
  finalize=finalize,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaRowRms(op.Op):
  """The plain jnp version (every op needs an "xla" implementation)."""

  name = "xla"
  spec = SPEC

  def _fwd(self, args, config):
    return reference(args), None


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """Args: block_cols: columns summed per scan step."""

  block_cols: int = 128

  def __post_init__(self):
    if self.block_cols < 1:
      raise ValueError(f"`block_cols` must be positive, got {self.block_cols}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockedRowRms(op.Op):
  """Sums squares over column blocks in a scan; JAX differentiates it."""

  name = "blocked"
  spec = SPEC
  config_cls = BlockConfig

  def _fwd(self, args, config):
    x = args.x.astype(jnp.float32)
    m, n = x.shape
    block = min(config.block_cols, n)
    count = math.ceil(n / block)
    x = jnp.pad(x, ((0, 0), (0, count * block - n)))
    blocks = jnp.moveaxis(x.reshape(m, count, block), 1, 0)  # [count, M, block]
    total, _ = jax.lax.scan(lambda acc, xb: (acc + (xb * xb).sum(-1), None), jnp.zeros(m), blocks)
    return jnp.sqrt(total / n).astype(args.x.dtype), None

  def _get_heuristics_config(self, args):
    return BlockConfig(block_cols=min(128, args.x.shape[1]))

  def _get_autotuning_configs(self, args):
    n = args.x.shape[1]
    return {BlockConfig(block_cols=min(b, n)) for b in (16, 32, 64, 128)}


def row_rms(x: Float[Array, "*B N"], *, implementation=None) -> Float[Array, "*B"]:
  """Root-mean-square of each row of `x` (over the last axis).

  Args:
    x: Input [*B, N].
    implementation: "xla", "blocked", an `Op`, a sequence of them, or None.

  Returns:
    [*B] row RMS values.
  """
  return SPEC(x, implementation=implementation)
