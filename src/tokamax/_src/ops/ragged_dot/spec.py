"""The ragged_dot op: a grouped matmul over contiguous row groups.

Three layouts, the ones a forward pass and its two gradients need:
- "default": lhs [M,K] @ rhs[g] [K,N] for the rows of group g -> [M,N].
- "rhs_transposed": lhs [M,K] @ rhs[g].T with rhs [G,N,K] -> [M,N].
- "ragged_contracting": lhs [M,K], rhs [M,N], out[g] = lhs[rows g].T @ rhs[rows g] -> [G,K,N].
Rows past sum(group_sizes) take part in no group: zero output rows, no contribution.
With `group_offset` o, only groups o .. o+G-1 of `group_sizes` are computed.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from tokamax._src import arguments, numerics, validation
from tokamax._src.ops import op
from tokamax._src.ops import partitioning as partitioning_lib

DEFAULT = "default"
RHS_TRANSPOSED = "rhs_transposed"
RAGGED_CONTRACTING = "ragged_contracting"
LAYOUTS = (DEFAULT, RHS_TRANSPOSED, RAGGED_CONTRACTING)


def dimension_numbers(layout: str) -> jax.lax.RaggedDotDimensionNumbers:
  """The `jax.lax.RaggedDotDimensionNumbers` of one of the three layouts."""
  contracting = {DEFAULT: ([1], [1]), RHS_TRANSPOSED: ([1], [2]), RAGGED_CONTRACTING: ([0], [0])}
  return jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(contracting[layout], ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[] if layout == RAGGED_CONTRACTING else [0],
  )


def layout_of(dims: jax.lax.RaggedDotDimensionNumbers) -> str:
  def norm(d):
    (lc, rc), (lb, rb) = d.dot_dimension_numbers
    return (
      tuple(lc),
      tuple(rc),
      tuple(lb),
      tuple(rb),
      tuple(d.lhs_ragged_dimensions),
      tuple(d.rhs_group_dimensions),
    )

  for layout in LAYOUTS:
    if norm(dims) == norm(dimension_numbers(layout)):
      return layout
  raise NotImplementedError(
    f"`ragged_dot_dimension_numbers` {dims} is not one of the supported layouts {LAYOUTS}."
  )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedDotGroupSizes:
  """Group sizes with a representative distribution, used as the tuning key.

  Attributes:
    value: The group sizes [G], possibly traced.
    representative_value: Concrete sizes with the same sum, shaped like `value`.
  """

  value: Int[Array, " G"]
  representative_value: tuple[int, ...] = dataclasses.field(metadata={"static": True})

  @property
  def shape(self):
    return self.value.shape


def generate_ragged_dot_group_sizes(
  m: int, num_groups: int, *, seed: int = 0, alpha: float = 1.0, empty_fraction: float = 0.0
) -> np.ndarray:
  """Random uneven group sizes summing to `m`, like a router's token counts.

  Args:
    m: Total rows.
    num_groups: Number of groups.
    seed: Random seed.
    alpha: Dirichlet concentration; small values give very uneven sizes.
    empty_fraction: Fraction of groups forced to be empty.

  Returns:
    int32 sizes [num_groups] summing to `m`.
  """
  if m < 0 or num_groups < 1:
    raise ValueError(f"need m >= 0 and num_groups >= 1, got m={m}, num_groups={num_groups}.")
  rng = np.random.default_rng(seed)
  weights = rng.dirichlet(np.full(num_groups, alpha))
  empty = rng.permutation(num_groups)[: round(empty_fraction * num_groups)]
  if len(empty) < num_groups:
    weights[empty] = 0.0
    weights /= weights.sum()
  return rng.multinomial(m, weights).astype(np.int32)


@arguments.op_arguments
class RaggedDotArgs:
  """Canonical arguments; `num_groups` is the number of groups computed."""

  lhs: Float[Array, "M K"]
  rhs: Float[Array, "..."]
  group_sizes: Int[Array, " G_all"]
  group_offset: Int[Array, "1"] | None
  layout: str = arguments.static()
  precision: object = arguments.static()
  out_dtype: object = arguments.static()
  representative_sizes: tuple[int, ...] | None = arguments.static()
  num_groups: int = arguments.static()

  @property
  def out_shape(self) -> tuple[int, ...]:
    m, k = self.lhs.shape
    if self.layout == DEFAULT:
      return (m, self.rhs.shape[2])
    if self.layout == RHS_TRANSPOSED:
      return (m, self.rhs.shape[1])
    return (self.num_groups, k, self.rhs.shape[1])


def canonicalize(
  lhs,
  rhs,
  group_sizes,
  ragged_dot_dimension_numbers=None,
  precision=None,
  preferred_element_type=None,
  group_offset=None,
  num_local_groups=None,
) -> RaggedDotArgs:
  layout = (
    DEFAULT if ragged_dot_dimension_numbers is None else layout_of(ragged_dot_dimension_numbers)
  )
  lhs = validation.floating("lhs", lhs)
  rhs = validation.floating("rhs", rhs)
  validation.same_dtype(lhs=lhs, rhs=rhs)
  validation.rank("lhs", lhs, 2, "lhs [M, K]")
  representative = None
  if isinstance(group_sizes, RaggedDotGroupSizes):
    representative = tuple(int(g) for g in group_sizes.representative_value)
    group_sizes = group_sizes.value
  group_sizes = validation.integer("group_sizes", group_sizes)
  validation.rank("group_sizes", group_sizes, 1, "group_sizes [G]")
  if representative is not None and len(representative) != group_sizes.shape[0]:
    raise ValueError("`group_sizes.representative_value` must have one entry per group.")
  validation.concrete_within("group_sizes", group_sizes, 0)
  m, k = lhs.shape
  g_all = group_sizes.shape[0]
  if layout == RAGGED_CONTRACTING:
    validation.rank("rhs", rhs, 2, "rhs [M, N] for a ragged contracting dimension")
    if rhs.shape[0] != m:
      raise ValueError(f"`rhs` rows {rhs.shape[0]} must equal `lhs` rows {m}.")
    local = num_local_groups if num_local_groups is not None else g_all
  else:
    validation.rank("rhs", rhs, 3, "rhs [G, K, N]" if layout == DEFAULT else "rhs [G, N, K]")
    kdim = 1 if layout == DEFAULT else 2
    if rhs.shape[kdim] != k:
      raise ValueError(
        f"`rhs` contracting dim {rhs.shape[kdim]} must equal `lhs` K={k} ({layout})."
      )
    local = rhs.shape[0]
  if group_offset is None and local != g_all:
    raise ValueError(f"`group_sizes` must have one entry per group: got {g_all}, expected {local}.")
  if group_offset is not None:
    group_offset = validation.integer("group_offset", group_offset)
    if group_offset.shape not in ((), (1,)):
      raise ValueError(f"`group_offset` must have shape (1,), got {group_offset.shape}.")
    group_offset = group_offset.reshape(1).astype(jnp.int32)
    if local > g_all:
      raise ValueError(f"{local} local groups exceed the {g_all} entries of `group_sizes`.")
  out_dtype = (
    validation.dtype("preferred_element_type", preferred_element_type)
    if preferred_element_type is not None
    else lhs.dtype
  )
  return RaggedDotArgs(
    lhs=lhs,
    rhs=rhs,
    group_sizes=group_sizes.astype(jnp.int32),
    group_offset=group_offset,
    layout=layout,
    precision=validation.precision(precision),
    out_dtype=jnp.dtype(out_dtype),
    representative_sizes=representative,
    num_groups=local,
  )


def dims(args: RaggedDotArgs) -> tuple[int, int, int]:
  """(M, K, N) of the product, whatever the layout."""
  m, k = args.lhs.shape
  n = args.rhs.shape[1] if args.layout == RHS_TRANSPOSED else args.rhs.shape[-1]
  return m, k, n


def kernel_unsupported_reason(
  args: RaggedDotArgs, dtypes: tuple[str, ...], out_dtypes: tuple[str, ...]
) -> str | None:
  """The checks every ragged_dot kernel makes: input and output dtypes, empty dims."""
  dtype = np.dtype(args.lhs.dtype).name
  if dtype not in dtypes:
    return f"input dtype {dtype} (supported: {', '.join(dtypes)})"
  if np.dtype(args.out_dtype).name not in out_dtypes:
    return f"preferred_element_type {np.dtype(args.out_dtype).name}"
  m, k, n = dims(args)
  if min(m, k, n, args.num_groups) == 0:
    return f"empty dimension (M={m}, K={k}, N={n}, G={args.num_groups})"
  return None


def cost(args: RaggedDotArgs) -> op.Cost:
  m, k, n = dims(args)
  itemsize = np.dtype(args.lhs.dtype).itemsize
  out = int(np.prod(args.out_shape))
  return op.Cost(
    flops=2.0 * m * k * n,
    bytes=float(
      itemsize * (args.lhs.size + args.rhs.size) + np.dtype(args.out_dtype).itemsize * out
    ),
  )


def _timing_group_sizes(
  args: RaggedDotArgs, shape: tuple[int, ...], rng: np.random.Generator
) -> np.ndarray:
  """Integer inputs for timing: the representative sizes, else random uneven ones."""
  if args.representative_sizes is not None:
    return np.asarray(args.representative_sizes, np.int32)
  seed = int(rng.integers(1 << 31))
  return generate_ragged_dot_group_sizes(args.lhs.shape[0], shape[0], seed=seed)


def _zero_offset(args: RaggedDotArgs, shape: tuple[int, ...], rng: np.random.Generator):
  del args, rng
  return np.zeros(shape, np.int32)


def _localize(args: RaggedDotArgs, shards) -> RaggedDotArgs:
  """One shard's rows (their share of every group) and groups (through `group_offset`)."""
  sizes, offset, groups = args.group_sizes, args.group_offset, args.num_groups
  if "m" in shards:
    m = args.lhs.shape[0]
    first = shards["m"].index() * m
    ends = jnp.cumsum(sizes)
    sizes = jnp.clip(ends - first, 0, m) - jnp.clip(ends - sizes - first, 0, m)
  if "g" in shards:
    groups = args.rhs.shape[0]
    start = (shards["g"].index() * groups).reshape(1)
    offset = start if offset is None else offset + start
  return dataclasses.replace(
    args,
    group_sizes=sizes.astype(jnp.int32),
    group_offset=None if offset is None else offset.astype(jnp.int32),
    num_groups=groups,
  )


def partitioning(args: RaggedDotArgs) -> partitioning_lib.Rule:
  """Rows of lhs (each shard's share of every group), output columns and, for expert
  parallelism, the groups of rhs (through `group_offset`; the shards' outputs add up)."""
  if args.layout == RAGGED_CONTRACTING:
    rhs, out = ("m", "n"), (None, "k", "n")
  else:
    rhs = ("g", "k", "n") if args.layout == DEFAULT else ("g", "n", "k")
    out = ("m", "n")
  return partitioning_lib.Rule(
    inputs={"lhs": ("m", "k"), "rhs": rhs, "group_sizes": (None,), "group_offset": (None,)},
    output=out,
    split=frozenset(("m", "n", "g")),
    combine="sum",
    localize=_localize,
  )


SPEC = op.OpSpec(
  name="ragged_dot",
  canonicalize=canonicalize,
  implementations={
    "xla": "tokamax._src.ops.ragged_dot.xla:XlaRaggedDot",
    "triton": "tokamax._src.ops.ragged_dot.triton:TritonRaggedDot",
    "mosaic": "tokamax._src.ops.ragged_dot.mosaic:MosaicRaggedDot",
    "mosaic_tpu": "tokamax._src.ops.ragged_dot.mosaic_tpu:MosaicTpuRaggedDot",
  },
  preference={"gpu": ("mosaic", "triton"), "tpu": ("mosaic_tpu",)},
  # "mosaic" is the Mosaic kernel of the platform: Mosaic GPU's, or Mosaic TPU's on a TPU.
  platform_names={"mosaic": {"tpu": "mosaic_tpu"}},
  cost=cost,
  integer_inputs={"group_sizes": _timing_group_sizes, "group_offset": _zero_offset},
  partitioning=partitioning,
)


def local_group_sizes(args: RaggedDotArgs) -> tuple[jax.Array, jax.Array | None]:
  """Sizes of the computed groups, and the rows before them (None without offset)."""
  if args.group_offset is None:
    return args.group_sizes, None
  g = args.num_groups
  starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(args.group_sizes)])
  offset = args.group_offset[0]
  before = starts[offset]
  sizes = jax.lax.dynamic_slice_in_dim(
    jnp.concatenate([args.group_sizes, jnp.zeros(g, jnp.int32)]), offset, g
  )
  return sizes, before


def group_row_bounds(
  sizes: jax.Array, before: jax.Array | None, m: int
) -> tuple[jax.Array, jax.Array]:
  """int32 first and end row of each group, clipped to [0, m].

  Args:
    sizes: [G] rows of each computed group, in row order.
    before: Rows before the first computed group (None: zero).
    m: Rows of lhs.
  """
  before = jnp.zeros((), jnp.int32) if before is None else before.astype(jnp.int32)
  ends = jnp.minimum(before + jnp.cumsum(sizes.astype(jnp.int32)), m)
  starts = jnp.concatenate([jnp.minimum(before, m)[None], ends[:-1]])
  return starts, jnp.maximum(ends, starts)


# For each layout: the layouts and operands of the two gradients, as
# (layout, lhs operand, rhs operand); "dout" is the output cotangent.
_GRADIENTS = {
  DEFAULT: {"lhs": (RHS_TRANSPOSED, "dout", "rhs"), "rhs": (RAGGED_CONTRACTING, "lhs", "dout")},
  RHS_TRANSPOSED: {"lhs": (DEFAULT, "dout", "rhs"), "rhs": (RAGGED_CONTRACTING, "dout", "lhs")},
  RAGGED_CONTRACTING: {"lhs": (RHS_TRANSPOSED, "rhs", "dout"), "rhs": (DEFAULT, "lhs", "dout")},
}


def gradients(args: RaggedDotArgs, dout: jax.Array, compute) -> dict[str, jax.Array]:
  """The lhs and rhs cotangents, each one ragged dot of another layout.

  Args:
    args: The forward call.
    dout: The output cotangent.
    compute: Computes a `RaggedDotArgs` record (the implementation's forward).

  Returns:
    {"lhs": ..., "rhs": ...} in the dtypes of the inputs.
  """
  operands = {"lhs": args.lhs, "rhs": args.rhs, "dout": dout.astype(args.lhs.dtype)}
  grads = {}
  for name, (layout, a, b) in _GRADIENTS[args.layout].items():
    record = dataclasses.replace(
      args,
      lhs=operands[a],
      rhs=operands[b],
      layout=layout,
      out_dtype=numerics.accumulation_dtype(operands[a].dtype),
      num_groups=args.num_groups,
    )
    grads[name] = compute(record).astype(operands[name].dtype)
  return grads
