"""ragged_dot and ragged_dot_general against the dense one-hot float64 reference."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from suites.core.conftest import assert_matches, references
from tokamax._src import jaxprs
from tokamax._src.ops.ragged_dot import spec

M, K, N = 45, 24, 13
SIZES = {
  "uneven": [10, 0, 17, 3, 15],
  "empty_groups": [0, 20, 0, 0, 25],
  "short_sum": [5, 9, 0, 4, 2],  # rows past the sum take part in no group
  "one_group_all": [0, 0, 45, 0, 0],
}


def _offset_ragged_dot(layout, sizes, offset, local):
  """The op (XLA) over `local` groups from `offset`, as a function of lhs and rhs."""
  return lambda lhs, rhs: spec.SPEC(
    lhs,
    rhs,
    sizes,
    spec.dimension_numbers(layout),
    group_offset=jnp.array([offset]),
    num_local_groups=local,
    implementation="xla",
  )


def _rhs(layout, inputs, g):
  if layout == spec.DEFAULT:
    return inputs.normal((g, K, N))
  if layout == spec.RHS_TRANSPOSED:
    return inputs.normal((g, N, K))
  return inputs.normal((M, N))


@pytest.mark.parametrize("impl", ("xla", None))
@pytest.mark.parametrize("layout", spec.LAYOUTS)
@pytest.mark.parametrize("sizes", SIZES)
def test_layouts(sizes, layout, impl, inputs):
  group_sizes = jnp.array(SIZES[sizes], jnp.int32)
  lhs = inputs.normal((M, K))
  rhs = _rhs(layout, inputs, len(SIZES[sizes]))

  def run(lhs, rhs):
    return tokamax.ragged_dot_general(
      lhs, rhs, group_sizes, spec.dimension_numbers(layout), implementation=impl
    )

  out = run(lhs, rhs)
  dout = inputs.normal(out.shape)
  ref_out, ref_grads = references.high_precision_vjp(
    lambda a, b: references.ragged_dot_general(a, b, group_sizes, layout), (lhs, rhs), dout
  )
  assert_matches(out, ref_out, what="output")
  grads = jax.vjp(run, lhs, rhs)[1](dout)
  assert_matches(grads[0], ref_grads[0], what="dlhs")
  assert_matches(grads[1], ref_grads[1], what="drhs")
  if layout != spec.RAGGED_CONTRACTING and sizes == "short_sum":
    assert np.all(np.asarray(out)[sum(SIZES[sizes]) :] == 0), "rows past the groups must be zero"


@pytest.mark.parametrize("layout", spec.LAYOUTS)
@pytest.mark.parametrize("offset", (0, 2, 3))
def test_group_offset(layout, offset, inputs):
  sizes = jnp.array([7, 0, 11, 9, 6, 8], jnp.int32)
  local = 3
  lhs = inputs.normal((M, K))
  rhs = _rhs(layout, inputs, local)
  out = _offset_ragged_dot(layout, sizes, offset, local)(lhs, rhs)
  ref = references.high_precision(references.ragged_dot_general)(
    lhs, rhs, sizes, layout, jnp.array([offset]), local
  )
  assert_matches(out, ref)


def test_ragged_dot_matches_default_layout_and_group_sizes_object(inputs):
  sizes = tokamax.generate_ragged_dot_group_sizes(M, 4, seed=3)
  assert sizes.sum() == M and sizes.shape == (4,) and sizes.dtype == np.int32
  lhs, rhs = inputs.normal((M, K)), inputs.normal((4, K, N))
  wrapped = tokamax.RaggedDotGroupSizes(jnp.asarray(sizes), tuple(int(s) for s in sizes))
  out = tokamax.ragged_dot(lhs, rhs, wrapped, preferred_element_type=jnp.float32)
  ref = references.high_precision(references.ragged_dot_general)(lhs, rhs, sizes, "default")
  assert_matches(out, ref)


def test_group_sizes_object_through_jit_keeps_its_representative_sizes_static(inputs):
  """A `RaggedDotGroupSizes` handed to a jitted function: its value is traced, its
  representative sizes (the tuning key) stay static Python ints, and the product is the
  reference's."""
  sizes = jnp.array([10, 0, 17, 3, 15], jnp.int32)
  wrapped = tokamax.RaggedDotGroupSizes(sizes, (9, 9, 9, 9, 9))
  assert len(jax.tree.leaves(wrapped)) == 1
  lhs, rhs = inputs.normal((M, K)), inputs.normal((5, K, N))
  out = jax.jit(lambda a, b, g: tokamax.ragged_dot(a, b, g, implementation="xla"))(
    lhs, rhs, wrapped
  )
  ref = references.high_precision(references.ragged_dot_general)(lhs, rhs, sizes, "default")
  assert_matches(out, ref)


def test_generated_sizes_are_uneven_and_can_be_empty():
  sizes = tokamax.generate_ragged_dot_group_sizes(4096, 16, seed=1, alpha=0.5, empty_fraction=0.25)
  assert sizes.sum() == 4096
  assert (sizes == 0).sum() >= 4
  assert sizes.max() > 2 * sizes[sizes > 0].min()


@pytest.mark.parametrize("preferred", (None, jnp.float32), ids=("default", "float32"))
def test_preferred_element_type_is_the_output_dtype(preferred, inputs):
  """bfloat16 inputs: the output is bfloat16 by default, float32 when asked for (and then
  holds the float32-accumulated products, not their bfloat16 rounding)."""
  sizes = jnp.array([10, 0, 17, 3, 15], jnp.int32)
  lhs = inputs.normal((M, K)).astype(jnp.bfloat16)
  rhs = inputs.normal((5, K, N)).astype(jnp.bfloat16)
  out = tokamax.ragged_dot(lhs, rhs, sizes, preferred_element_type=preferred)
  assert out.dtype == (jnp.bfloat16 if preferred is None else jnp.float32)
  ref = references.high_precision(references.ragged_dot_general)(lhs, rhs, sizes, "default")
  if preferred is not None:
    assert_matches(out, ref)


@pytest.mark.parametrize(
  ("dtype", "sizes"),
  ((jnp.int8, [100, 0, 120]), (jnp.uint8, [200, 0, 100])),
  ids=("int8", "uint8"),
)
def test_narrow_integer_group_sizes_whose_sum_overflows_them(dtype, sizes, inputs):
  """Group sizes of a narrow integer dtype give the groups they give as int32, though their
  sum (the last group's end row) does not fit that dtype."""
  lhs = inputs.normal((300, 8))
  rhs = inputs.normal((3, 8, 5))
  out = tokamax.ragged_dot(lhs, rhs, jnp.array(sizes, dtype), implementation="xla")
  ref = references.high_precision(references.ragged_dot_general)(
    lhs, rhs, jnp.array(sizes, jnp.int32), "default"
  )
  assert_matches(out, ref)


@pytest.mark.parametrize("layout", spec.LAYOUTS)
@pytest.mark.parametrize(
  ("sizes", "offset", "local"),
  (([5, 30, 20, 4, 6], 1, 2), ([5, 3, 8, 10, 6], 3, 3)),
  ids=("groups_overflow_the_rows", "groups_past_the_last_size"),
)
def test_group_offset_at_the_edges_with_gradients(layout, sizes, offset, local, inputs):
  """Local groups whose sizes add up past M (their rows stop at M), and local groups past the
  last entry of `group_sizes` (empty): the value and both cotangents."""
  sizes = jnp.array(sizes, jnp.int32)
  lhs = inputs.normal((M, K))
  rhs = _rhs(layout, inputs, local)
  out, vjp = jax.vjp(_offset_ragged_dot(layout, sizes, offset, local), lhs, rhs)
  dout = inputs.normal(out.shape)
  ref, ref_grads = references.high_precision_vjp(
    lambda a, b: references.ragged_dot_general(a, b, sizes, layout, jnp.array([offset]), local),
    (lhs, rhs),
    dout,
  )
  assert_matches(out, ref)
  for name, g, r in zip(("dlhs", "drhs"), vjp(dout), ref_grads, strict=True):
    assert_matches(g, r, what=name)


@pytest.mark.parametrize("impl", ("xla", None))
def test_ragged_dot_passes_the_group_offset_on(impl, inputs):
  """The public `ragged_dot` with `group_offset`: rhs holds groups 2 and 3 only; the rows of
  the other groups are zero."""
  sizes = jnp.array([7, 0, 11, 9, 6], jnp.int32)
  offset = jnp.array([2], jnp.int32)
  lhs, rhs = inputs.normal((M, K)), inputs.normal((2, K, N))
  out = tokamax.ragged_dot(lhs, rhs, sizes, group_offset=offset, implementation=impl)
  ref = references.high_precision(references.ragged_dot_general)(
    lhs, rhs, sizes, "default", offset, 2
  )
  assert_matches(out, ref)
  assert np.all(np.asarray(out)[:7] == 0) and np.all(np.asarray(out)[27:] == 0)


def test_a_scalar_group_offset_is_the_one_element_offset(inputs):
  """`group_offset` as a scalar (shape ()) is taken as the [1] array it stands for."""
  sizes = jnp.array([7, 0, 11, 9, 6], jnp.int32)
  lhs, rhs = inputs.normal((M, K)), inputs.normal((2, K, N))
  out = tokamax.ragged_dot(lhs, rhs, sizes, group_offset=jnp.int32(2), implementation="xla")
  ref = references.high_precision(references.ragged_dot_general)(
    lhs, rhs, sizes, "default", jnp.array([2]), 2
  )
  assert_matches(out, ref)


@pytest.mark.parametrize("layout", spec.LAYOUTS)
@pytest.mark.parametrize("offset", (None, 1))
def test_float64_matches_the_reference(layout, offset):
  """float64 inputs take dense one-hot matmuls (XLA:GPU has no float64 grouped GEMM): each row
  in exactly its group's product (uneven and empty groups, rows past the sum), value and VJP."""
  sizes = jnp.array([6, 0, 11, 1, 9], jnp.int32)  # 27 of M rows.
  local = 5 if offset is None else 3
  with jax.enable_x64(True):
    rng = np.random.default_rng(5)
    lhs = jnp.asarray(rng.standard_normal((M, K)))
    shapes = {spec.DEFAULT: (local, K, N), spec.RHS_TRANSPOSED: (local, N, K)}
    rhs = jnp.asarray(rng.standard_normal(shapes.get(layout, (M, N))))
    group_offset = None if offset is None else jnp.array([offset])

    def run(lhs, rhs):
      return spec.SPEC(
        lhs,
        rhs,
        sizes,
        spec.dimension_numbers(layout),
        group_offset=group_offset,
        num_local_groups=None if offset is None else local,
        implementation="xla",
      )

    out, vjp = jax.vjp(run, lhs, rhs)
    dout = jnp.asarray(rng.standard_normal(out.shape))
    ref, ref_grads = references.high_precision_vjp(
      lambda a, b: references.ragged_dot_general(a, b, sizes, layout, group_offset, local),
      (lhs, rhs),
      dout,
    )
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    for g, r in zip(vjp(dout), ref_grads, strict=True):
      assert g.dtype == jnp.float64
      np.testing.assert_allclose(g, r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("x64", (False, True), ids=("float32", "float64"))
def test_only_float64_takes_the_dense_one_hot_matmuls(x64):
  """XLA's grouped GEMM (`ragged_dot_general`) for float32, whose dense one-hot form costs G
  times the work; float64, which XLA:GPU has no grouped GEMM for, takes the one-hot form."""
  sizes = jnp.array([6, 0, 11, 1, 9], jnp.int32)
  with jax.enable_x64(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    lhs, rhs = jax.ShapeDtypeStruct((M, K), dtype), jax.ShapeDtypeStruct((5, K, N), dtype)
    run = lambda a, b: tokamax.ragged_dot(a, b, sizes, implementation="xla")
    jaxpr = jax.make_jaxpr(run)(lhs, rhs)
  names = {e.primitive.name for e in jaxprs.equations(jaxpr.jaxpr)}
  assert ("ragged_dot_general" in names) != x64, names


def test_positional_arguments_are_those_of_jax_lax(inputs):
  """precision, preferred_element_type and group_offset by position, as jax.lax takes them:
  bfloat16 inputs with a float32 output asked for."""
  sizes = jnp.array([7, 0, 11, 9, 6], jnp.int32)
  lhs = inputs.normal((M, K)).astype(jnp.bfloat16)
  rhs = inputs.normal((5, K, N)).astype(jnp.bfloat16)
  dims = spec.dimension_numbers(spec.DEFAULT)
  precision = jax.lax.Precision.HIGHEST
  calls = (
    (tokamax.ragged_dot(lhs, rhs, sizes, precision, jnp.float32, None), "ragged_dot"),
    (tokamax.ragged_dot_general(lhs, rhs, sizes, dims, precision, jnp.float32, None), "general"),
  )
  expected = jax.lax.ragged_dot(lhs, rhs, sizes, precision, jnp.float32)
  assert expected.dtype == jnp.float32
  for out, name in calls:
    assert out.dtype == jnp.float32, name
    assert_matches(out, expected, what=name)


@pytest.mark.parametrize("seed", range(6))
def test_generated_sizes_leave_the_forced_fraction_of_groups_empty(seed):
  """Half of 8 groups forced empty: at least 4 get no rows, whichever they are (the last one
  too), and the rows all go to the others."""
  sizes = tokamax.generate_ragged_dot_group_sizes(4096, 8, seed=seed, empty_fraction=0.5)
  assert sizes.sum() == 4096 and (sizes >= 0).all()
  assert (sizes == 0).sum() >= 4, sizes


@pytest.mark.parametrize("seed", range(3))
def test_generated_sizes_follow_the_concentration(seed):
  """A large Dirichlet concentration gives near-equal groups (8 groups of 1024 rows on
  average: a weight's standard deviation is about 9% of it at alpha=100), a small one
  piles most rows on one group."""
  even = tokamax.generate_ragged_dot_group_sizes(8192, 8, seed=seed, alpha=100.0)
  assert even.sum() == 8192 and np.all(np.abs(even - 1024) < 400), even
  skewed = tokamax.generate_ragged_dot_group_sizes(8192, 8, seed=seed, alpha=0.05)
  assert skewed.sum() == 8192 and skewed.max() > 4096, skewed


def test_generated_sizes_with_every_group_forced_empty_still_sum_to_m():
  """An empty fraction of one leaves no group to take the rows: none is forced empty then."""
  sizes = tokamax.generate_ragged_dot_group_sizes(100, 4, seed=2, empty_fraction=1.0)
  assert sizes.sum() == 100 and sizes.shape == (4,) and sizes.dtype == np.int32
  assert (sizes >= 0).all()


@pytest.mark.parametrize(("m", "g"), ((10, 0), (-1, 3)))
def test_generated_sizes_refuse_no_groups_or_negative_rows(m, g):
  with pytest.raises(ValueError, match="num_groups"):
    tokamax.generate_ragged_dot_group_sizes(m, g)


def test_timing_inputs_take_the_representative_sizes_and_group_zero():
  """Timing runs draw the representative sizes where there are some (else random sizes summing
  to M, one per group) and start at group zero."""
  lhs, rhs = jnp.ones((M, K)), jnp.ones((4, K, N))
  wrapped = tokamax.RaggedDotGroupSizes(jnp.array([40, 5, 0, 0]), (10, 15, 0, 20))
  record = spec.canonicalize(lhs, rhs, wrapped, group_offset=jnp.array([0]))
  draw = spec.SPEC.integer_inputs
  rng = np.random.default_rng(0)
  sizes = draw["group_sizes"](record, (4,), rng)
  np.testing.assert_array_equal(sizes, [10, 15, 0, 20])
  plain = spec.canonicalize(lhs, rhs, jnp.array([40, 5, 0, 0]))
  sizes = draw["group_sizes"](plain, (4,), rng)
  assert sizes.shape == (4,) and sizes.sum() == M and sizes.dtype == np.int32
  offset = draw["group_offset"](record, (1,), rng)
  np.testing.assert_array_equal(offset, [0])
  assert offset.dtype == np.int32


class _Shard:
  """A stand-in for `partitioning.Shard` at a fixed position."""

  def __init__(self, index):
    self._index = index

  def index(self):
    return jnp.int32(self._index)


@pytest.mark.parametrize("shard", (0, 1, 2))
def test_localize_rows_takes_each_shards_share_of_every_group(shard):
  """A shard of 16 of the 48 rows computes, of each group, the rows it holds (hand count)."""
  sizes = jnp.array([10, 0, 17, 3, 15], jnp.int32)  # Rows 0-9, -, 10-26, 27-29, 30-44.
  record = spec.canonicalize(jnp.ones((48, 4)), jnp.ones((5, 4, 3)), sizes)
  local = spec._localize(dataclasses.replace(record, lhs=jnp.ones((16, 4))), {"m": _Shard(shard)})
  want = {0: [10, 0, 6, 0, 0], 1: [0, 0, 11, 3, 2], 2: [0, 0, 0, 0, 13]}[shard]
  np.testing.assert_array_equal(local.group_sizes, want)
  assert local.group_offset is None and local.num_groups == 5


@pytest.mark.parametrize(("offset", "groups"), ((None, 6), (1, 4)))
def test_localize_groups_shifts_the_group_offset(offset, groups):
  """The second of two shards of the groups of rhs starts at its first group, past the call's
  own offset: group 3 either way."""
  sizes = jnp.array([7, 0, 11, 9, 6, 8], jnp.int32)
  group_offset = None if offset is None else jnp.array([offset])
  record = spec.canonicalize(
    jnp.ones((45, 4)),
    jnp.ones((groups, 4, 3)),
    sizes,
    group_offset=group_offset,
    num_local_groups=groups,
  )
  shard_rhs = jnp.ones((groups // 2, 4, 3))
  local = spec._localize(dataclasses.replace(record, rhs=shard_rhs), {"g": _Shard(1)})
  np.testing.assert_array_equal(local.group_offset, [3])
  assert local.num_groups == groups // 2
  np.testing.assert_array_equal(local.group_sizes, sizes)


@pytest.mark.parametrize("layout", spec.LAYOUTS)
def test_partitioning_labels_match_the_dims(layout):
  """Each split label of the sharding rule names axes of one size across lhs, rhs and the
  output (M=45, K=24, N=13, G=5 here), and the shards' outputs add up."""
  sizes = jnp.array([10, 0, 17, 3, 15], jnp.int32)
  shapes = {
    spec.DEFAULT: (5, K, N),
    spec.RHS_TRANSPOSED: (5, N, K),
    spec.RAGGED_CONTRACTING: (M, N),
  }
  record = spec.canonicalize(
    jnp.ones((M, K)), jnp.ones(shapes[layout]), sizes, spec.dimension_numbers(layout)
  )
  rule = spec.partitioning(record)
  want = {"m": M, "k": K, "n": N, "g": 5}
  shapes = {"lhs": (M, K), "rhs": record.rhs.shape, "group_sizes": (5,), "group_offset": (1,)}
  for name, labels in rule.inputs.items():
    assert len(labels) == len(shapes[name]), name
    for label, size in zip(labels, shapes[name], strict=True):
      assert label is None or want[label] == size, (name, labels)
  assert len(rule.output) == len(record.out_shape)
  for label, size in zip(rule.output, record.out_shape, strict=True):
    assert label is None or want[label] == size, rule.output
  assert rule.combine == "sum" and rule.split == {"m", "n", "g"}


@pytest.mark.parametrize("offset", (None, 1))
@pytest.mark.parametrize("layout", spec.LAYOUTS)
def test_gradients_are_ragged_dots_of_the_other_layouts(layout, offset):
  """`spec.gradients` with a dense reference as each gradient's ragged dot: the VJP of the
  forward (float64 check), float32 records for bfloat16 inputs, results in the inputs' dtype."""
  sizes = jnp.array([10, 0, 17, 3, 15], jnp.int32)
  local = 5 if offset is None else 3
  group_offset = None if offset is None else jnp.array([offset])
  shapes = {spec.DEFAULT: (local, K, N), spec.RHS_TRANSPOSED: (local, N, K)}
  rng = np.random.default_rng(11)
  lhs = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal(shapes.get(layout, (M, N))), jnp.bfloat16)
  record = spec.canonicalize(
    lhs,
    rhs,
    sizes,
    spec.dimension_numbers(layout),
    group_offset=group_offset,
    num_local_groups=None if offset is None else local,
  )
  dout = jnp.asarray(rng.standard_normal(record.out_shape), jnp.float32)
  records = []

  def compute(r):
    records.append(r)
    f32 = [x.astype(jnp.float32) for x in (r.lhs, r.rhs)]
    out = references.ragged_dot_general(*f32, r.group_sizes, r.layout, r.group_offset, local)
    return out.astype(r.out_dtype)

  grads = spec.gradients(record, dout, compute)
  assert [r.out_dtype for r in records] == [jnp.float32, jnp.float32]
  # The float32 cotangent is cast to the inputs' dtype: a kernel's matmul takes one dtype.
  assert all(r.lhs.dtype == r.rhs.dtype == jnp.bfloat16 for r in records), [
    (r.lhs.dtype, r.rhs.dtype) for r in records
  ]
  assert grads["lhs"].dtype == grads["rhs"].dtype == jnp.bfloat16
  with jax.enable_x64(True):
    a, b = (np.asarray(x, np.float64) for x in (lhs, rhs))
    ct = np.asarray(dout.astype(jnp.bfloat16), np.float64)
    _, vjp = jax.vjp(
      lambda a, b: references.ragged_dot_general(a, b, sizes, layout, group_offset, local), a, b
    )
    want = vjp(ct)
  for name, w in zip(("lhs", "rhs"), want, strict=True):
    got = np.asarray(grads[name], np.float64)
    np.testing.assert_allclose(got, w, rtol=2e-2, atol=2e-2 * np.abs(w).max(), err_msg=name)


@pytest.mark.skipif(jax.default_backend() == "tpu", reason="Mosaic TPU runs here")
def test_the_public_ragged_dot_passes_the_implementation_on():
  """An implementation that cannot run here is refused by name, not replaced by XLA."""
  lhs, rhs = jnp.ones((4, 8)), jnp.ones((2, 8, 16))
  with pytest.raises(NotImplementedError, match="mosaic_tpu: runs on tpu"):
    tokamax.ragged_dot(lhs, rhs, jnp.array([2, 2], jnp.int32), implementation="mosaic_tpu")


def test_xla_under_two_vmaps_matches_the_reference(inputs):
  """vmap of vmap: the inner batch is mapped too (XLA's ragged dot has no batching rule)."""
  lhs, rhs = inputs.normal((2, 3, 8, 4)), inputs.normal((2, 3, 2, 4, 5))
  sizes = jnp.array([3, 5], jnp.int32)
  out = jax.vmap(jax.vmap(lambda a, b: tokamax.ragged_dot(a, b, sizes, implementation="xla")))(
    lhs, rhs
  )
  ref = jax.vmap(jax.vmap(lambda a, b: references.ragged_dot_general(a, b, sizes, "default")))
  assert_matches(out, references.high_precision(ref)(lhs, rhs))


@pytest.mark.parametrize("layout", spec.LAYOUTS)
def test_gradient_of_the_gradient(layout, inputs):
  """Reverse over reverse (the gradient of a squared gradient norm, in lhs and rhs) against
  JAX's derivatives of the float64 reference. The XLA forward's `custom_vmap` cannot be
  linearized, so differentiating the op's backward (ragged dots of the other layouts) failed
  ("Linearization failed to produce known values")."""
  group_sizes = jnp.array(SIZES["short_sum"], jnp.int32)
  lhs = inputs.normal((M, K))
  rhs = _rhs(layout, inputs, len(SIZES["short_sum"]))
  dout = inputs.normal(
    (len(SIZES["short_sum"]), K, N) if layout == spec.RAGGED_CONTRACTING else (M, N)
  )

  def gradient_of_gradient(fn, lhs, rhs):
    grad = jax.grad(lambda a, b: (fn(a, b) * dout).sum(), (0, 1))
    return jax.grad(lambda a, b: sum((g**2).sum() for g in grad(a, b)), (0, 1))(lhs, rhs)

  got = gradient_of_gradient(
    lambda a, b: tokamax.ragged_dot_general(
      a, b, group_sizes, spec.dimension_numbers(layout), implementation="xla"
    ),
    lhs,
    rhs,
  )
  want = references.high_precision(
    lambda a, b: gradient_of_gradient(
      lambda a, b: references.ragged_dot_general(a, b, group_sizes, layout), a, b
    )
  )(lhs, rhs)
  assert_matches(got[0], want[0], what="d|grad|^2/dlhs")
  assert_matches(got[1], want[1], what="d|grad|^2/drhs")
