"""dot_product_attention (xla, xla_chunked) against the float64 reference, every feature."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import tokamax
from suites.core.conftest import assert_matches, references
from tokamax._src import jaxprs
from tokamax._src.ops.attention import spec, xla, xla_chunked

IMPLEMENTATIONS = ("xla", "xla_chunked", None)


@dataclasses.dataclass(frozen=True)
class Case:
  """One attention call: shapes and features."""

  name: str
  batch: tuple[int, ...] = (2,)
  t: int = 24
  s: int = 24
  n: int = 4
  k: int = 4
  h: int = 16
  hv: int = 16
  bias: tuple[int, ...] | None = None  # shape, as a broadcast of [*B, N, T, S]
  mask: tuple[int, ...] | None = None
  is_causal: bool = False
  q_lengths: bool = False
  kv_lengths: bool = False
  window: int | tuple[int, int] | None = None
  soft_cap: float | None = None
  scale: float | None = None


CASES = [
  Case("plain"),
  Case("gqa", n=8, k=2),
  Case("mqa", n=6, k=1),
  Case("no_batch", batch=()),
  Case("two_batch_dims", batch=(2, 3), t=12, s=12),
  Case("value_head_dim_differs", hv=8),
  Case("t_ne_s", t=20, s=33),
  Case("causal", is_causal=True),
  Case("causal_t_lt_s", t=13, s=30, is_causal=True),
  Case("causal_t_gt_s", t=30, s=13, is_causal=True),
  Case("bias_full", bias=(2, 4, 24, 24)),
  Case("bias_bcast_batch", bias=(1, 4, 24, 24)),
  Case("bias_bcast_heads", bias=(2, 1, 24, 24)),
  Case("bias_bcast_rows", bias=(2, 4, 1, 24)),
  Case("bias_bcast_cols", bias=(2, 4, 24, 1)),
  Case("bias_no_batch_dims", bias=(4, 24, 24)),
  Case("bias_two_batch_dims", batch=(2, 3), t=12, s=12, bias=(1, 3, 1, 12, 12)),
  # Fewer batch dims than the query: they align with its last batch dims (numpy broadcasting).
  Case(
    "bias_mask_fewer_batch_dims", batch=(2, 3), t=12, s=12, bias=(3, 4, 12, 12), mask=(3, 1, 1, 12)
  ),
  Case("mask_full", mask=(2, 4, 24, 24)),
  Case("mask_bcast", mask=(1, 1, 24, 24)),
  Case("mask_bcast_heads_rows", mask=(2, 1, 1, 24)),
  Case("bias_and_mask_gqa", n=8, k=2, bias=(2, 8, 24, 24), mask=(2, 1, 24, 24)),
  Case("q_lengths", q_lengths=True),
  Case("kv_lengths", kv_lengths=True),
  Case("both_lengths_causal", q_lengths=True, kv_lengths=True, is_causal=True),
  Case("window_int", window=3),
  Case("window_pair", window=(5, 0)),
  Case("window_pair_asym_causal", window=(4, 2), is_causal=True),
  Case("soft_cap", soft_cap=2.0),
  Case("soft_cap_bias", soft_cap=1.5, bias=(2, 4, 24, 24)),
  Case("scale", scale=0.3),
  Case(
    "odd_sizes_everything",
    t=37,
    s=53,
    n=6,
    k=3,
    h=8,
    hv=12,
    bias=(2, 1, 37, 53),
    mask=(2, 6, 1, 53),
    is_causal=True,
    kv_lengths=True,
    window=(9, 4),
    soft_cap=3.0,
  ),
]


def make(case: Case, inputs):
  q = inputs.normal((*case.batch, case.t, case.n, case.h))
  k = inputs.normal((*case.batch, case.s, case.k, case.h))
  v = inputs.normal((*case.batch, case.s, case.k, case.hv))
  bias = None if case.bias is None else inputs.normal(case.bias)
  mask = None if case.mask is None else inputs.bools(case.mask)
  kwargs = dict(
    is_causal=case.is_causal,
    local_window_size=case.window,
    logits_soft_cap=case.soft_cap,
    scale=case.scale,
  )
  if case.q_lengths:
    kwargs["query_seq_lengths"] = inputs.ints(case.batch, 1, case.t)
  if case.kv_lengths:
    kwargs["key_value_seq_lengths"] = inputs.ints(case.batch, 1, case.s)
  return (q, k, v, bias, mask), kwargs


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_and_gradient(case, impl, inputs):
  arrays, kwargs = make(case, inputs)
  q, k, v, bias, mask = arrays

  def run(q, k, v, bias):
    return tokamax.dot_product_attention(q, k, v, bias, mask, implementation=impl, **kwargs)

  def reference(q, k, v, bias):
    return references.attention(q, k, v, bias, mask, **kwargs)

  out = run(q, k, v, bias)
  dout = inputs.normal(out.shape)
  differentiable = (q, k, v) + (() if bias is None else (bias,))
  ref_out, ref_grads = references.high_precision_vjp(
    lambda *a: reference(*a, *(() if bias is not None else (None,))), differentiable, dout
  )
  assert_matches(out, ref_out, what="output")
  _, vjp = jax.vjp(lambda *a: run(*a, *(() if bias is not None else (None,))), *differentiable)
  for name, g, ref in zip(("dq", "dk", "dv", "dbias"), vjp(dout), ref_grads, strict=False):
    assert_matches(g, ref, what=name)


@pytest.mark.parametrize("impl", ("xla", "xla_chunked"))
def test_rows_that_see_nothing_are_zero(impl, inputs):
  q = inputs.normal((2, 10, 2, 8))
  k = inputs.normal((2, 10, 2, 8))
  v = inputs.normal((2, 10, 2, 8))
  lengths = jnp.array([4, 10])
  mask = jnp.ones((10, 10), bool).at[7].set(False)[None, None]
  out = tokamax.dot_product_attention(
    q, k, v, mask=mask, query_seq_lengths=lengths, implementation=impl
  )
  assert np.all(np.asarray(out[0, 4:]) == 0), "padded query rows must be zero"
  assert np.all(np.asarray(out[:, 7]) == 0), "fully masked rows must be zero"
  assert np.all(np.abs(np.asarray(out[1, :7])).sum(-1) > 0), "visible rows must be written"


@pytest.mark.parametrize("is_causal", (True, False), ids=("causal", "full"))
@pytest.mark.parametrize("chunk", (1, 5, 7, 64))
def test_chunked_any_chunk_size(chunk, is_causal, inputs):
  """19 keys in chunks that need not divide them: without causality the zero-padded keys of
  the last partial chunk would be visible to every row."""
  q, k, v = (inputs.normal((1, 19, 2, 8)) for _ in range(3))
  op = xla_chunked.XlaChunkedAttention(config=xla_chunked.ChunkedConfig(kv_chunk_size=chunk))
  out = tokamax.dot_product_attention(q, k, v, is_causal=is_causal, implementation=op)
  expected = references.high_precision(references.attention)(q, k, v, is_causal=is_causal)
  assert_matches(out, expected)


@pytest.mark.parametrize("chunk", (5, 64))
def test_chunked_logits_far_below_zero(chunk, inputs):
  """Every logit near -120 (a bias; exp underflows in float32 there): the running row max
  starts at -inf, not 0, or exp(logit - 0) is zero and every row comes out empty."""
  q, k, v = (inputs.normal((1, 19, 2, 8)) for _ in range(3))
  bias = inputs.normal((1, 2, 19, 19)) - 120.0
  op = xla_chunked.XlaChunkedAttention(config=xla_chunked.ChunkedConfig(kv_chunk_size=chunk))
  run = lambda q, k, v, bias: tokamax.dot_product_attention(q, k, v, bias, implementation=op)
  out, vjp = jax.vjp(run, q, k, v, bias)
  dout = inputs.normal(out.shape)
  ref_out, ref_grads = references.high_precision_vjp(references.attention, (q, k, v, bias), dout)
  assert_matches(out, ref_out)
  for name, g, ref in zip(("dq", "dk", "dv", "dbias"), vjp(dout), ref_grads, strict=True):
    assert_matches(g, ref, what=name)


@pytest.mark.parametrize("impl", ("xla", "xla_chunked"))
def test_bfloat16_inputs_give_bfloat16_output(impl, inputs):
  """The output and the gradients take the inputs' dtype, not the float32 accumulator's."""
  q, k, v = (inputs.normal((2, 12, 4, 8)).astype(jnp.bfloat16) for _ in range(3))
  run = lambda q, k, v: tokamax.dot_product_attention(q, k, v, implementation=impl)
  out, vjp = jax.vjp(run, q, k, v)
  assert out.dtype == jnp.bfloat16, out.dtype
  assert [g.dtype for g in vjp(jnp.ones_like(out))] == [jnp.bfloat16] * 3
  expected = references.high_precision(references.attention)(q, k, v)
  np.testing.assert_allclose(
    np.asarray(out, np.float32), np.asarray(expected, np.float32), rtol=3e-2, atol=3e-2
  )


def _dot_general_shapes(jaxpr) -> list[tuple[int, ...]]:
  """The output shapes of every dot_general in `jaxpr`, nested jaxprs included."""
  return [
    tuple(v.aval.shape)
    for eqn in jaxprs.equations(jaxpr.jaxpr)
    if eqn.primitive.name == "dot_general"
    for v in eqn.outvars
  ]


@pytest.mark.parametrize("is_causal", [False, True])
def test_xla_logits_come_out_of_their_matmul_with_keys_minor(is_causal):
  """The logits' dot_general itself yields [B,K,G,T,S]: with `jnp.einsum`'s operand order it
  yields [B,K,S,T,G] and a transpose, XLA lays the logits out with T minor, and its GPU softmax
  fusion does not form (1.47x the forward time on the H200; numerics cannot see it)."""
  b, t, s, n, kh, h = 2, 8, 16, 4, 2, 32
  q = jax.ShapeDtypeStruct((b, t, n, h), jnp.float32)
  kv = jax.ShapeDtypeStruct((b, s, kh, h), jnp.float32)
  run = lambda q, k, v: tokamax.dot_product_attention(
    q, k, v, is_causal=is_causal, implementation="xla"
  )
  for jaxpr in (
    jax.make_jaxpr(run)(q, kv, kv),
    jax.make_jaxpr(jax.grad(lambda *a: run(*a).sum()))(q, kv, kv),
  ):
    shapes = _dot_general_shapes(jaxpr)
    assert (b, kh, n // kh, t, s) in shapes, shapes


@pytest.mark.parametrize("chunk", (1, 5, 19, 64))
def test_chunked_scans_ceil_s_over_chunk_steps_of_chunk_keys(chunk):
  """Memory linear in S (the module's docstring): forward and gradient scan ceil(S / C) key
  chunks of C keys (at most S), so the keys are padded by less than one chunk and a step's
  logits are [B, K, G, T, C]. 19 keys: 19, 4, 1 and 1 steps."""
  b, t, s, n, kh, h = 1, 8, 19, 4, 2, 6
  q = jax.ShapeDtypeStruct((b, t, n, h), jnp.float32)
  kv = jax.ShapeDtypeStruct((b, s, kh, h), jnp.float32)
  op = xla_chunked.XlaChunkedAttention(config=xla_chunked.ChunkedConfig(kv_chunk_size=chunk))
  run = lambda q, k, v: tokamax.dot_product_attention(q, k, v, implementation=op)
  size = min(chunk, s)
  steps = -(-s // size)
  for jaxpr in (
    jax.make_jaxpr(run)(q, kv, kv),
    jax.make_jaxpr(jax.grad(lambda *a: run(*a).sum(), argnums=(0, 1, 2)))(q, kv, kv),
  ):
    lengths = [
      e.params["length"] for e in jaxprs.equations(jaxpr.jaxpr) if e.primitive.name == "scan"
    ]
    assert lengths and set(lengths) == {steps}, lengths
    shapes = _dot_general_shapes(jaxpr)
    assert (b, kh, n // kh, t, size) in shapes, shapes


@pytest.mark.parametrize(
  ("s", "expected"), [(4096, (128, 256, 512, 1024, 2048)), (300, (128, 256, 300))]
)
def test_chunked_autotuning_candidates_are_powers_of_two_capped_at_s(s, expected):
  """The key chunks autotuning times: the powers of two from 128 to 2048 (each divides a
  power-of-two S, so no chunk is padded), any above S cut to S (one chunk of every key)."""
  structs = [jax.ShapeDtypeStruct(x, jnp.float32) for x in ((1, 8, 2, 16), (1, s, 2, 16))]
  record = jax.eval_shape(lambda q, k: spec.canonicalize(q, k, k), *structs)
  configs = xla_chunked.XlaChunkedAttention()._get_autotuning_configs(record)
  assert sorted(c.kv_chunk_size for c in configs) == list(expected)


POSITIONAL_CASES = [c for c in CASES if c.is_causal or c.window is not None]


@pytest.mark.parametrize("case", POSITIONAL_CASES, ids=lambda c: c.name)
def test_xla_query_blocks_match_the_reference(case, inputs, monkeypatch):
  """Causal or windowed calls in blocks of 5 query rows, each over only the keys it can see
  (the forward; under differentiation the implementation computes one block)."""
  monkeypatch.setattr(xla, "QUERY_BLOCK_ROWS", 5)
  test_forward_and_gradient(case, "xla", inputs)


@pytest.mark.parametrize(
  ("t", "s", "causal", "window", "expected"),
  [
    (20, 20, True, None, [(0, 5, 0, 5), (5, 10, 0, 10), (10, 15, 0, 15), (15, 20, 0, 20)]),
    (12, 30, True, None, [(0, 5, 0, 5), (5, 10, 0, 10), (10, 12, 0, 12)]),
    (20, 20, False, (3, 1), [(0, 5, 0, 6), (5, 10, 2, 11), (10, 15, 7, 16), (15, 20, 12, 20)]),
    (15, 4, False, (0, 0), [(0, 5, 0, 4), (5, 10, 3, 4), (10, 15, 3, 4)]),
    (20, 20, False, None, [(0, 20, 0, 20)]),
    (9, 9, True, None, [(0, 9, 0, 9)]),
    (10, 10, True, None, [(0, 5, 0, 5), (5, 10, 0, 10)]),
  ],
)
def test_xla_query_blocks_cover_the_visible_keys(t, s, causal, window, expected, monkeypatch):
  """Each block's key range is exactly the keys its rows may see (numerics cannot tell a block
  that computes every key, only the time can); fewer than two blocks' rows stay one block."""
  monkeypatch.setattr(xla, "QUERY_BLOCK_ROWS", 5)
  q = jnp.zeros((1, t, 2, 8))
  kv = jnp.zeros((1, s, 2, 8))
  args = spec.canonicalize(q, kv, kv, is_causal=causal, local_window_size=window)
  assert xla.query_blocks(args) == expected


@pytest.mark.parametrize(
  "bias_shape",
  [(2, 4, 24, 1), (1, 1, 24, 1), (2, 1, 24, 24)],
  ids=("keys_broadcast", "all_but_rows_broadcast", "heads_broadcast"),
)
def test_chunked_bias_gradient_over_several_chunks(bias_shape, inputs):
  """The bias cotangent accumulated over 4 key chunks of 7 (the last one partial), for biases
  broadcast along the keys (one column summed over every chunk) and along other axes (each
  chunk's columns written in place, into a cotangent padded to the chunks)."""
  q, k, v = (inputs.normal((2, 24, 4, 8)) for _ in range(3))
  bias = inputs.normal(bias_shape)
  op = xla_chunked.XlaChunkedAttention(config=xla_chunked.ChunkedConfig(kv_chunk_size=7))
  kwargs = dict(is_causal=True)
  run = lambda *a: tokamax.dot_product_attention(*a, implementation=op, **kwargs)
  out, vjp = jax.vjp(run, q, k, v, bias)
  dout = inputs.normal(out.shape)
  ref_out, ref_grads = references.high_precision_vjp(
    lambda *a: references.attention(*a, **kwargs), (q, k, v, bias), dout
  )
  assert_matches(out, ref_out)
  for name, g, ref in zip(("dq", "dk", "dv", "dbias"), vjp(dout), ref_grads, strict=True):
    assert_matches(g, ref, what=name)


def test_window_and_length_forms_canonicalize_alike():
  """A window as an int (Python or numpy), a pair or a list is one (left, right) window; a
  scalar sequence length applies to every batch entry (flattened from the batch dims)."""
  q = jnp.ones((2, 3, 4, 2, 8))
  for window in (3, np.int32(3), np.int64(3), (3, 3), [3, 3]):
    assert spec.canonicalize(q, q, q, local_window_size=window).local_window == (3, 3), window
  assert spec.canonicalize(q, q, q, local_window_size=[4, 0]).local_window == (4, 0)
  args = spec.canonicalize(q, q, q, query_seq_lengths=2, key_value_seq_lengths=jnp.array([1, 3, 4]))
  np.testing.assert_array_equal(args.q_seq_lengths, [2] * 6)
  np.testing.assert_array_equal(args.kv_seq_lengths, [1, 3, 4] * 2)
  assert args.q_seq_lengths.dtype == jnp.int32


def test_timing_inputs_take_every_sequence_at_its_full_length():
  """Timing runs fill the query lengths with T and the key/value lengths with S (here
  T = 5 and S = 9, so swapped fields would give rows or keys past their sequence)."""
  q = jnp.ones((3, 5, 2, 8))
  kv = jnp.ones((3, 9, 2, 8))
  lengths = jnp.array([1, 2, 3])
  args = spec.canonicalize(q, kv, kv, query_seq_lengths=lengths, key_value_seq_lengths=lengths)
  draw = spec.SPEC.integer_inputs
  rng = np.random.default_rng(0)
  q_lengths = draw["q_seq_lengths"](args, (3,), rng)
  kv_lengths = draw["kv_seq_lengths"](args, (3,), rng)
  np.testing.assert_array_equal(q_lengths, [5, 5, 5])
  np.testing.assert_array_equal(kv_lengths, [9, 9, 9])
  assert q_lengths.dtype == kv_lengths.dtype == np.int32


@pytest.mark.parametrize("blocked", (False, True), ids=("one_block", "query_blocks"))
def test_xla_causal_logits_far_above_zero(blocked, inputs, monkeypatch):
  """Causal logits in the hundreds, with no bias or mask array (XLA's unfused row max):
  exp overflows float32 past 88, so the row max must be the row's own, not 0; the output
  matches float64 numpy, in one block and in query blocks of 4 rows."""
  if blocked:
    monkeypatch.setattr(xla, "QUERY_BLOCK_ROWS", 4)
  q, k, v = (inputs.normal((1, 11, 2, 8)) for _ in range(3))
  args = spec.canonicalize(q, k, v, scale=80.0, is_causal=True)
  out = np.asarray(xla.attend(args, blocked=blocked)[0], np.float64)
  qd, kd, vd = (np.asarray(x, np.float64) for x in (q, k, v))
  logits = 80.0 * np.einsum("btnh,bsnh->bnts", qd, kd)
  logits = np.where(np.tril(np.ones((11, 11), bool)), logits, -np.inf)
  assert np.abs(logits[np.isfinite(logits)]).max() > 100
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  expected = np.einsum("bnts,bsnh->btnh", probs / probs.sum(-1, keepdims=True), vd)
  np.testing.assert_allclose(out, expected, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_no_keys_gives_zero_rows_and_zero_gradients(impl, inputs):
  """S = 0: every query row sees no key, so (by the op's definition) outputs zeros and gets a
  zero gradient; the key, value and bias cotangents are empty. Differentiating used to fail
  on a chunk size of 0."""
  q = inputs.normal((2, 5, 4, 8))
  k, v = jnp.zeros((2, 0, 2, 8)), jnp.zeros((2, 0, 2, 6))
  bias = jnp.zeros((2, 4, 5, 0))
  run = lambda q, k, v, bias: tokamax.dot_product_attention(
    q, k, v, bias, is_causal=True, implementation=impl
  )
  out, vjp = jax.vjp(run, q, k, v, bias)
  assert out.shape == (2, 5, 4, 6)
  np.testing.assert_array_equal(np.asarray(out), 0.0)
  dq, dk, dv, dbias = vjp(inputs.normal(out.shape))
  np.testing.assert_array_equal(np.asarray(dq), 0.0)
  assert (dk.shape, dv.shape, dbias.shape) == (k.shape, v.shape, bias.shape)


@pytest.mark.parametrize("blocks", (False, True), ids=("one_block", "query_blocks"))
@pytest.mark.parametrize(
  "visibility", ({"is_causal": True}, {"local_window_size": 2}), ids=("causal", "window")
)
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_no_keys_from_positions_alone(impl, visibility, blocks, inputs, monkeypatch):
  """S = 0 with a causal mask or a window and no bias or mask array (XLA's row max then has
  no floor to start from): zero rows and zero gradients, in one block and in query blocks of
  5 rows, instead of a max over no keys raising."""
  if blocks:
    monkeypatch.setattr(xla, "QUERY_BLOCK_ROWS", 5)
  q = inputs.normal((2, 12, 4, 8))
  k, v = jnp.zeros((2, 0, 2, 8)), jnp.zeros((2, 0, 2, 6))
  run = lambda q: tokamax.dot_product_attention(q, k, v, implementation=impl, **visibility)
  np.testing.assert_array_equal(np.asarray(run(q)), 0.0)
  out, vjp = jax.vjp(run, q)
  assert out.shape == (2, 12, 4, 6)
  np.testing.assert_array_equal(np.asarray(out), 0.0)
  np.testing.assert_array_equal(np.asarray(vjp(inputs.normal(out.shape))[0]), 0.0)


@pytest.mark.parametrize(("t", "s"), [(8, 0), (0, 8)], ids=["no_keys", "no_queries"])
@pytest.mark.parametrize("name", ["mosaic", "triton", "cudnn", "mosaic_tpu"])
def test_kernels_refuse_empty_inputs_that_xla_computes(name, t, s):
  """A kernel given no keys (or no queries) names it, so that `None` falls back to XLA (the
  Mosaic and cuDNN kernels took S = 0 before)."""
  q = jnp.ones((1, t, 2, 64), jnp.bfloat16)
  kv = jnp.ones((1, s, 2, 64), jnp.bfloat16)
  args = spec.SPEC.canonicalize(q, kv, kv)
  op = spec.SPEC.implementation_class(name)()
  assert op._unsupported_reason(args) == "empty query, key or value"


def test_cudnn_takes_a_window_only_with_the_causal_mask():
  """cuDNN's sliding window bounds keys on the left; the causal mask bounds the right."""
  q = jnp.ones((1, 16, 2, 64), jnp.bfloat16)
  op = spec.SPEC.implementation_class("cudnn")()
  for window in (3, (3, 0), (3, 5)):
    causal = spec.SPEC.canonicalize(q, q, q, is_causal=True, local_window_size=window)
    assert op._unsupported_reason(causal) is None, window
    plain = spec.SPEC.canonicalize(q, q, q, local_window_size=window)
    assert op._unsupported_reason(plain) == "local_window_size without is_causal", window


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_zero_scale_is_a_scale_not_the_default(impl, inputs):
  """scale=0.0 weighs every visible key alike (each causal row i is the mean of values
  0..i); a falsy scale taken as "no scale given" would apply 1/sqrt(H) instead."""
  q, k, v = (inputs.normal((2, 6, 2, 8)) for _ in range(3))
  out = tokamax.dot_product_attention(q, k, v, scale=0.0, is_causal=True, implementation=impl)
  rows = np.arange(1, 7, dtype=np.float64)[None, :, None, None]
  assert_matches(out, np.cumsum(np.asarray(v, np.float64), axis=1) / rows)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_a_mask_of_rank_two_and_a_bias_of_rank_one_broadcast(impl, inputs):
  """A mask [T, S] and a bias [S] have fewer dims than the [*B, N, T, S] they broadcast to
  (numpy aligns them on the right): they apply to every batch entry and head, and the bias
  cotangent sums over all of them."""
  q = inputs.normal((2, 3, 10, 4, 8))
  k, v = inputs.normal((2, 3, 12, 2, 8)), inputs.normal((2, 3, 12, 2, 8))
  bias, mask = inputs.normal((12,)), inputs.bools((10, 12))
  run = lambda q, k, v, bias: tokamax.dot_product_attention(
    q, k, v, bias, mask, implementation=impl
  )
  out, vjp = jax.vjp(run, q, k, v, bias)
  dout = inputs.normal(out.shape)
  ref_out, ref_grads = references.high_precision_vjp(
    lambda *a: references.attention(*a, mask), (q, k, v, bias), dout
  )
  assert_matches(out, ref_out)
  for name, g, ref in zip(("dq", "dk", "dv", "dbias"), vjp(dout), ref_grads, strict=True):
    assert_matches(g, ref, what=name)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_bfloat16_gradient_of_values_equal_at_every_key_is_zero(impl, inputs):
  """Values equal at every key make the output that value whatever the logits, so dq is
  exactly zero: ds = p (dO.v - rowsum(dO * O)) cancels only where both dP = dO.v and the row
  sum (delta) are formed in float32, neither rounded to bfloat16 (an error of ~2^-9 |delta|).
  Zero queries and power-of-two S keep every probability and output exact in bfloat16."""
  bf16 = jnp.bfloat16
  q = jnp.zeros((2, 8, 4, 16), bf16)
  k = jnp.ones((2, 16, 2, 16), bf16)
  v = jnp.broadcast_to(inputs.normal((2, 1, 2, 16)), (2, 16, 2, 16)).astype(bf16)
  run = lambda q: tokamax.dot_product_attention(q, k, v, implementation=impl)
  out, vjp = jax.vjp(run, q)
  expected = np.repeat(np.asarray(v[:, :8], np.float32), 2, axis=2)  # Query head n: K/V n // 2.
  np.testing.assert_array_equal(np.asarray(out, np.float32), expected)
  (dq,) = vjp(inputs.normal(out.shape, scale=4.0).astype(bf16))
  assert np.abs(np.asarray(dq, np.float32)).max() < 1e-4


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_bias_of_another_dtype_gets_a_cotangent_of_its_own_dtype(impl, inputs):
  """A bfloat16 bias on float32 queries: the bias cotangent is bfloat16 (the primal's dtype),
  not the queries' float32, and matches the float64 reference's at bfloat16 tolerance."""
  q, k, v = (inputs.normal((2, 12, 4, 8)) for _ in range(3))
  bias = inputs.normal((2, 4, 12, 12)).astype(jnp.bfloat16)
  run = lambda q, bias: tokamax.dot_product_attention(q, k, v, bias, implementation=impl)
  out, vjp = jax.vjp(run, q, bias)
  dout = inputs.normal(out.shape)
  dq, dbias = vjp(dout)
  assert (dq.dtype, dbias.dtype) == (jnp.float32, jnp.bfloat16)
  _, (_, ref) = references.high_precision_vjp(
    lambda q, bias: references.attention(q, k, v, bias), (q, bias), dout
  )
  np.testing.assert_allclose(np.asarray(dbias, np.float32), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("impl", ("xla", "xla_chunked"))
def test_q_sharding_takes_a_bias_and_mask_of_fewer_dims(impl, inputs):
  """`q_sharding` with a bias [T, S] or [S] and a mask [S], which have no batch or head dims
  to split (they go whole to every shard): the output matches the reference's, instead of
  failing to index a head dim they lack."""
  mesh = jax.make_mesh((1,), ("d",), axis_types=(AxisType.Auto,))
  sharding = NamedSharding(mesh, PartitionSpec("d", None, None, None))
  q = jax.device_put(inputs.normal((2, 10, 4, 8)), sharding)
  k, v = inputs.normal((2, 12, 2, 8)), inputs.normal((2, 12, 2, 8))
  mask = inputs.bools((12,))
  for bias in (inputs.normal((10, 12)), inputs.normal((12,))):
    out = jax.jit(
      lambda q, k, v, bias: tokamax.dot_product_attention(
        q, k, v, bias, mask, implementation=impl, q_sharding=sharding
      )
    )(q, k, v, bias)
    ref = references.high_precision(references.attention)(q, k, v, bias, mask)
    assert_matches(out, ref)
