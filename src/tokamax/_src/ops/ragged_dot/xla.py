"""ragged_dot through `jax.lax.ragged_dot_general`."""

import dataclasses

import jax
import jax.numpy as jnp

from tokamax._src import arguments as arguments_lib
from tokamax._src.ops import op
from tokamax._src.ops.ragged_dot import spec


def ragged_dot_xla(args: spec.RaggedDotArgs) -> jax.Array:
  """The XLA ragged dot; a group offset becomes two zero groups around the local ones.

  Its derivative is the other two layouts' ragged dots (`spec.gradients`): JAX cannot
  linearize the `custom_vmap` below, so without this the op's own backward (these same
  ragged dots) could not be differentiated again (a gradient of a gradient).
  """
  arrays = arguments_lib.array_fields(args)
  rebuild = lambda arrays: dataclasses.replace(args, **arrays)

  @jax.custom_vjp
  def run(arrays):
    return _batched_as_loop(rebuild(arrays))

  def run_fwd(arrays):
    return run(arrays), arrays

  def run_bwd(arrays, dout):
    grads = spec.gradients(rebuild(arrays), dout, ragged_dot_xla)
    return op.field_cotangents("ragged_dot[xla]", grads, arrays)

  run.defvjp(run_fwd, run_bwd)
  return run(arrays)


@jax.custom_batching.custom_vmap
def _batched_as_loop(args: spec.RaggedDotArgs) -> jax.Array:
  return _ragged_dot(args)


@_batched_as_loop.def_vmap
def _loop_over_batch(axis_size, in_batched, args):
  # jax.lax.ragged_dot_general has no general batching rule: map over the batch.
  args = jax.tree.map(
    lambda x, batched: x if batched else jnp.broadcast_to(x, (axis_size, *x.shape)),
    args,
    in_batched[0],
  )
  return jax.lax.map(_batched_as_loop, args), True


def _ragged_dot(args: spec.RaggedDotArgs) -> jax.Array:
  if args.lhs.dtype == jnp.float64:
    return _one_hot_ragged_dot(args)
  sizes, before = spec.local_group_sizes(args)
  rhs = args.rhs
  if before is not None:
    m = args.lhs.shape[0]
    after = m - before - sizes.sum()
    sizes = jnp.concatenate([before[None], sizes, jnp.maximum(after, 0)[None]])
    if args.layout != spec.RAGGED_CONTRACTING:
      zero = jnp.zeros((1, *rhs.shape[1:]), rhs.dtype)
      rhs = jnp.concatenate([zero, rhs, zero])
  out = jax.lax.ragged_dot_general(
    args.lhs,
    rhs,
    sizes,
    spec.dimension_numbers(args.layout),
    precision=args.precision,
    preferred_element_type=args.out_dtype,
  )
  if before is not None and args.layout == spec.RAGGED_CONTRACTING:
    out = out[1:-1]
  return out.astype(args.out_dtype)


def _one_hot_ragged_dot(args: spec.RaggedDotArgs) -> jax.Array:
  """Dense matmuls masked by each row's group: XLA:GPU has no float64 grouped GEMM."""
  sizes, before = spec.local_group_sizes(args)
  starts, ends = spec.group_row_bounds(sizes, before, args.lhs.shape[0])
  rows = jnp.arange(args.lhs.shape[0], dtype=jnp.int32)[:, None]
  one_hot = ((rows >= starts[None, :]) & (rows < ends[None, :])).astype(args.lhs.dtype)
  rhs = args.rhs
  kwargs = dict(precision=args.precision, preferred_element_type=args.out_dtype)
  if args.layout == spec.RAGGED_CONTRACTING:
    out = jnp.einsum("mg,mk,mn->gkn", one_hot, args.lhs, rhs, **kwargs)
  else:
    if args.layout == spec.RHS_TRANSPOSED:
      rhs = jnp.swapaxes(rhs, 1, 2)
    out = jnp.einsum("mg,mk,gkn->mn", one_hot, args.lhs, rhs, **kwargs)
  return out.astype(args.out_dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaRaggedDot(op.Op):
  """`jax.lax.ragged_dot_general`, with gradients from the other two layouts."""

  name = "xla"
  spec = spec.SPEC

  def _fwd(self, args, config):
    return ragged_dot_xla(args), None

  def _bwd(self, args, config, out, residuals, dout):
    return spec.gradients(args, dout, ragged_dot_xla)
