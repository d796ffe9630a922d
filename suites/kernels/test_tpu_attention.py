"""Mosaic TPU attention on CPU: the kernels in Pallas's TPU interpreter against
float64 references (forward and every gradient), the blocks that the masks
skip, the block cost model, and `jax.export` for a TPU v5e/v5p from a CPU host.

Not covered here (needs a TPU): Mosaic's own compilation of the lowered kernels
(layouts, VMEM allocation) and their speed.
"""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import tokamax
from suites import opdb
from tokamax._src import export, tpu
from tokamax._src.ops.attention import mosaic_tpu, mosaic_tpu_kernel, spec
from tokamax_harness import compare, references

# The summary counts these under the op and implementation they check.
# On any host the TPU kernels run in the TPU interpreter, on the host CPU.
pytestmark = [
  pytest.mark.op("dot_product_attention", "mosaic_tpu"),
  pytest.mark.usefixtures("on_cpu"),
  pytest.mark.host_only,
]

# `kernel_cases.AttentionKernelCase`s (in the op database).
CASES = opdb.get("dot_product_attention").kernel_cases["mosaic_tpu"]
_BOUND = {"float32": 1e-5, "bfloat16": 1e-2}
_LENGTHS = ("query_seq_lengths", "key_value_seq_lengths")


def _inputs(shape, dtype, seed=0):
  b, t, s, n, k, h = (shape[x] for x in "btsnkh")
  rng = np.random.default_rng(seed)
  draw = lambda *dims: jnp.asarray(rng.standard_normal(dims), dtype)
  return draw(b, t, n, h), draw(b, s, k, h), draw(b, s, k, shape.get("hv", h)), rng


@pytest.mark.parametrize("name", list(CASES))
def test_interpret_matches_reference_with_gradients(name):
  case = CASES[name]
  q, k, v, rng = _inputs(case.shape, case.dtype)
  kwargs = {
    key: jnp.asarray(value, jnp.int32) if key in _LENGTHS else value
    for key, value in case.features.items()
  }
  kwargs = {key: getattr(value, "draw", lambda v=value: v)() for key, value in kwargs.items()}
  primals = (q, k, v) if "bias" not in kwargs else (q, k, v, kwargs.pop("bias"))
  config = mosaic_tpu.MosaicTpuAttentionConfig(**case.config) if case.config else None
  impl = mosaic_tpu.MosaicTpuAttention(interpret=True, config=config)
  out, vjp = jax.vjp(
    lambda *a: tokamax.dot_product_attention(*a, implementation=impl, **kwargs), *primals
  )
  ct = jnp.asarray(rng.standard_normal(out.shape), case.dtype)
  ref, ref_grads = references.high_precision_vjp(
    lambda *a: references.attention(*a, **kwargs), primals, ct
  )
  grads = vjp(ct) if case.grads else ()
  labels = ("out", "dq", "dk", "dv", "dbias")[: 1 + len(grads)]
  for label, x, r in zip(labels, (out, *grads), (ref, *ref_grads[: len(grads)]), strict=True):
    dtype = primals[-1].dtype if label == "dbias" else q.dtype
    assert x.shape == r.shape and x.dtype == dtype, label
    assert np.all(np.isfinite(np.asarray(x, np.float32))), label
    assert compare.relative_error(x, r) < _BOUND[case.dtype], label
  if "key_value_seq_lengths" in kwargs:  # Batches whose rows see no key: zeros.
    empty = np.asarray(kwargs["key_value_seq_lengths"]) == 0
    assert np.all(np.asarray(out)[empty] == 0)
    assert all(np.all(np.asarray(g)[empty] == 0) for g in grads)


def test_interpret_on_two_cores_matches_reference():
  """A v5p megacore in the interpreter: two cores split the grid's "parallel" axes, in a random
  order. The key blocks of the forward and dq kernels, and the query heads of a group and
  query blocks of the dk/dv kernel, accumulate in VMEM and must stay on one core, in order."""
  # Three query blocks (a partial one), three key blocks, three query heads of one group: odd
  # numbers of grid points, so that an accumulating axis made parallel is split between cores.
  q, k, v, rng = _inputs(dict(b=1, t=40, s=384, n=3, k=1, h=64), "float32", seed=9)
  config = mosaic_tpu.MosaicTpuAttentionConfig(
    block_q=16, block_kv=128, bwd_block_q=16, bwd_block_kv=128
  )
  params = pltpu.InterpretParams(num_cores_or_threads=2, random_seed=7)
  impl = mosaic_tpu.MosaicTpuAttention(interpret=params, config=config)
  out, vjp = jax.vjp(lambda *a: tokamax.dot_product_attention(*a, implementation=impl), q, k, v)
  ct = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
  ref, ref_grads = references.high_precision_vjp(references.attention, (q, k, v), ct)
  for label, x, r in zip(
    ("out", "dq", "dk", "dv"), (out, *vjp(ct)), (ref, *ref_grads), strict=True
  ):
    assert compare.relative_error(x, r) < _BOUND["float32"], label


def test_lengths_past_the_sequence_mean_the_whole_sequence():
  """Sequence lengths above T and S see every row and key, and no more: the keys that pad S to
  whole blocks (zeros, logit 0) stay hidden."""
  q, k, v, _ = _inputs(dict(b=2, t=24, s=130, n=2, k=1, h=64), "float32")
  kwargs = dict(
    query_seq_lengths=jnp.array([30, 24], jnp.int32),
    key_value_seq_lengths=jnp.array([200, 256], jnp.int32),
  )
  config = mosaic_tpu.MosaicTpuAttentionConfig(block_q=8, block_kv=128)
  impl = mosaic_tpu.MosaicTpuAttention(interpret=True, config=config)
  out = tokamax.dot_product_attention(q, k, v, implementation=impl, **kwargs)
  ref = references.high_precision(references.attention)(q, k, v)
  assert compare.relative_error(out, ref) < _BOUND["float32"]


@pytest.mark.parametrize("seed", range(4))
def test_block_ranges_cover_every_visible_pair(seed):
  """`kv_blocks` and `q_blocks` (what the kernels visit) hold every visible pair, and only
  blocks that have one; `_whole` (no masking) holds for the blocks with nothing hidden."""
  rng = np.random.default_rng(seed)
  t, s = int(rng.integers(1, 300)), int(rng.integers(1, 300))
  causal = bool(seed % 2)
  window = None if seed == 1 else tuple(int(x) for x in rng.integers(0, 60, 2))
  p = mosaic_tpu_kernel.Params(
    block_q=int(rng.choice([8, 16, 32])), block_kv=128, scale=1.0, causal=causal, window=window
  )
  q_len, kv_len = int(rng.integers(0, t + 1)), int(rng.integers(0, s + 1))
  rows, keys = np.arange(t)[:, None], np.arange(s)[None, :]
  ok = (rows < q_len) & (keys < kv_len)
  if causal:
    ok &= keys <= rows
  if window is not None:
    ok &= (keys >= rows - window[0]) & (keys <= rows + window[1])
  nq, nk = -(-t // p.block_q), -(-s // p.block_kv)
  ok = np.pad(ok, ((0, nq * p.block_q - t), (0, nk * 128 - s)))  # Padding: never visible.
  pairs = np.zeros((nq, nk), bool)
  for i, j in itertools.product(range(nq), range(nk)):
    block = ok[i * p.block_q : (i + 1) * p.block_q, j * 128 : (j + 1) * 128]
    pairs[i, j] = block.any()
    # Blocks that skip the masking are those whose every pair is visible.
    assert bool(mosaic_tpu_kernel._whole(i, j, q_len, kv_len, p)) == block.all(), (i, j)
  for i in range(nq):
    first, last = (int(x) for x in mosaic_tpu_kernel.kv_blocks(i, q_len, kv_len, p))
    visited = np.zeros(nk, bool)
    visited[max(first, 0) : last + 1] = True
    np.testing.assert_array_equal(visited, pairs[i], err_msg=f"query block {i}")
  for j in range(nk):
    first, last = (int(x) for x in mosaic_tpu_kernel.q_blocks(j, q_len, kv_len, p))
    visited = np.zeros(nq, bool)
    visited[max(first, 0) : last + 1] = True
    np.testing.assert_array_equal(visited, pairs[:, j], err_msg=f"key block {j}")


@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("window", (None, (0, 0), (3, 9), (20, 2), (9, 30), (7, 17)))
@pytest.mark.parametrize(("block_q", "block_kv"), ((8, 16), (16, 8)))
def test_block_ranges_at_every_length(block_q, block_kv, causal, window):
  """Every query and key length of a 37 x 45 call, as `test_block_ranges_cover_every_visible_pair`
  checks a few random ones: blocks small against the window, so that partly hidden and whole
  blocks meet at every boundary (a length one past a block's last row or key, a window edge
  one key inside a block; left = 7 puts the left edge of a block's last row on a key block's
  first key). The block functions are index arithmetic: numpy runs them here."""
  t, s = 37, 45
  p = mosaic_tpu_kernel.Params(
    block_q=block_q, block_kv=block_kv, scale=1.0, causal=causal, window=window
  )
  nq, nk = -(-t // block_q), -(-s // block_kv)
  q_len = np.arange(t + 1)[:, None, None, None]
  kv_len = np.arange(s + 1)[None, :, None, None]
  rows = np.arange(nq * block_q)[None, None, :, None]
  keys = np.arange(nk * block_kv)[None, None, None, :]
  ok = (rows < q_len) & (keys < kv_len)  # Padded rows and keys (past T, S) fall out here.
  if causal:
    ok = ok & (keys <= rows)
  if window is not None:
    ok = ok & (keys >= rows - window[0]) & (keys <= rows + window[1])
  blocks = ok.reshape(t + 1, s + 1, nq, block_q, nk, block_kv)
  visible, whole = blocks.any(axis=(3, 5)), blocks.all(axis=(3, 5))  # [q_len, kv_len, i, j]
  i = np.arange(nq)[None, None, :, None]
  j = np.arange(nk)[None, None, None, :]
  got_whole = mosaic_tpu_kernel._whole(i, j, q_len, kv_len, p)
  np.testing.assert_array_equal(np.broadcast_to(got_whole, whole.shape), whole)
  first, last = mosaic_tpu_kernel.kv_blocks(i, q_len, kv_len, p, np)
  np.testing.assert_array_equal((j >= first) & (j <= last), visible)
  first, last = mosaic_tpu_kernel.q_blocks(j, q_len, kv_len, p, np)
  np.testing.assert_array_equal((i >= first) & (i <= last), visible)


def _export(fn, *shapes, device_kind="TPU v5 lite"):
  with export.abstract_tpu(device_kind):
    return jax.export.export(jax.jit(fn), platforms=("tpu",))(*shapes)


@pytest.mark.parametrize("implementation", ["mosaic_tpu", "mosaic", None])
@pytest.mark.parametrize("features", [{}, {"is_causal": True, "logits_soft_cap": 30.0}])
def test_export_for_tpu_v5_has_the_mosaic_tpu_calls(implementation, features):
  bf16 = jnp.bfloat16
  q = jax.ShapeDtypeStruct((2, 1000, 8, 128), bf16)
  kv = jax.ShapeDtypeStruct((2, 777, 2, 128), bf16)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)

  def forward(q, k, v, kv_len):
    return tokamax.dot_product_attention(
      q, k, v, key_value_seq_lengths=kv_len, implementation=implementation, **features
    )

  def forward_backward(q, k, v, kv_len):
    loss = lambda q, k, v: jnp.sum(forward(q, k, v, kv_len).astype(jnp.float32) ** 2)
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

  for fn, names in (
    (forward, ["fwd"]),
    (forward_backward, ["fwd", "dq", "dkv"]),
  ):
    exported = _export(fn, q, kv, kv, lengths)
    text = exported.mlir_module()
    assert exported.platforms == ("tpu",)
    assert text.count("tpu_custom_call") == len(names), fn.__name__
    for name in names:
      assert f"tokamax_flash_attention_{name}" in text, (fn.__name__, name)
    # No XLA attention: nothing is as large as the [B, N, T, S] logits.
    assert "2x8x1000x777" not in text and "2x2x4x1000x777" not in text


def test_export_with_bias_and_mask():
  q = jax.ShapeDtypeStruct((2, 300, 4, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 200, 2, 64), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct((1, 4, 1, 200), jnp.float32)
  mask = jax.ShapeDtypeStruct((2, 1, 300, 200), jnp.bool_)

  def loss(q, k, v, bias, mask):
    out = tokamax.dot_product_attention(q, k, v, bias, mask, implementation="mosaic")
    return jnp.sum(out.astype(jnp.float32))

  fn = jax.grad(loss, argnums=(0, 1, 2))
  assert _export(fn, q, kv, kv, bias, mask).mlir_module().count("tpu_custom_call") == 3


@pytest.mark.parametrize("bias_grad", [False, True])
def test_xla_bias_gradient_only_when_the_bias_is_differentiated(bias_grad):
  q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct((1, 2, 256, 256), jnp.float32)

  def loss(q, k, v, bias):
    out = tokamax.dot_product_attention(q, k, v, bias, implementation="mosaic_tpu")
    return jnp.sum(out.astype(jnp.float32))

  fn = jax.grad(loss, argnums=(0, 1, 2, 3) if bias_grad else (0, 1, 2))
  text = _export(fn, q, q, q, bias).mlir_module()
  assert text.count("tpu_custom_call") == 3
  assert ("stablehlo.exponential" in text) == bias_grad


def test_export_for_tpu_v5p_gqa_window():
  q = jax.ShapeDtypeStruct((1, 512, 4, 64), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, 512, 1, 64), jnp.float32)
  fn = lambda q, k, v: jax.grad(
    lambda q: jnp.sum(tokamax.dot_product_attention(q, k, v, local_window_size=(64, 0)))
  )(q)
  text = _export(fn, q, kv, kv, device_kind="TPU v5").mlir_module()
  assert text.count("tpu_custom_call") == 2  # The forward and dq kernels (dk/dv is not used).
  # The kernels ask Mosaic for v5p's scoped VMEM limit (32 MiB of its
  # 64 MiB), the limit their blocks were checked against.
  sizes = re.findall(r"\\22size\\22: (\d+)", text)
  assert sizes == [str(32 << 20)] * 2, sizes


def test_unsupported_reasons_at_the_edges():
  """The edges of what the kernels take (`test_unsupported_reasons_name_the_feature` names
  the refusals): head dims 64 to 256 in steps of 64, query blocks of 8 sublanes for float32
  and 16 for bfloat16, key blocks of whole 128-lane multiples."""

  def reason(dtype="float32", h=64, hv=None, **config):
    q = jnp.ones((1, 16, 2, h), dtype)
    v = jnp.ones((1, 16, 2, hv or h), dtype)
    config = mosaic_tpu.MosaicTpuAttentionConfig(**config)
    impl = mosaic_tpu.MosaicTpuAttention(interpret=True, config=config)
    return impl._unsupported_reason(spec.canonicalize(q, q, v))

  for h in (64, 128, 192, 256):
    assert reason(h=h) is None and reason(h=64, hv=h) is None, h
  assert "query head dim 320" in reason(h=320)
  assert "value head dim 320" in reason(h=64, hv=320)
  assert reason(block_q=8) is None
  assert "block_q=8 must be a multiple of 16" in reason("bfloat16", block_q=8)
  assert reason("bfloat16", block_q=16) is None
  assert "block_kv=192 must be a multiple of 128" in reason(block_kv=192)
  assert reason(block_kv=256) is None


def test_mosaic_names_the_platforms_kernel():
  assert spec.SPEC.platform_name("mosaic", "tpu") == "mosaic_tpu"
  assert spec.SPEC.platform_name("mosaic", "gpu") == "mosaic"
  assert spec.SPEC.default_order("tpu") == ("mosaic_tpu", "xla")
  with export.abstract_tpu():
    assert spec.SPEC.resolve("mosaic") == ["mosaic_tpu"]
    assert spec.SPEC.resolve(None) == ["mosaic_tpu", "xla"]


def test_unsupported_reasons_name_the_feature():
  impl = mosaic_tpu.MosaicTpuAttention(interpret=True)
  q = jnp.ones((1, 128, 2, 64), jnp.float32)
  kv = jnp.ones((1, 128, 1, 64), jnp.float32)
  cases = [
    (dict(query=q.astype(jnp.float16), key=kv.astype(jnp.float16)), "dtype float16"),
    (dict(query=jnp.ones((1, 128, 2, 32)), key=jnp.ones((1, 128, 1, 32))), "head dim 32"),
    (dict(value=jnp.ones((1, 128, 1, 96))), "value head dim 96"),
  ]
  for overrides, match in cases:
    a = {"query": q, "key": kv, **overrides}
    a.setdefault("value", a["key"])
    with pytest.raises(NotImplementedError, match=match):
      impl(a.pop("query"), a.pop("key"), a.pop("value"), **a)
  with_config = lambda **c: impl.with_config(mosaic_tpu.MosaicTpuAttentionConfig(**c))
  with pytest.raises(NotImplementedError, match="block_kv=64 must be a multiple of 128"):
    with_config(block_kv=64)(q, kv, kv)
  with pytest.raises(NotImplementedError, match="block_q=12 must be a multiple of 8"):
    with_config(block_q=12)(q, kv, kv)
  with pytest.raises(NotImplementedError, match="VMEM"):
    with_config(block_q=8192, block_kv=8192)(q, kv, kv)
  record = spec.canonicalize(q, kv, kv)
  assert "bwd_block_q=4" in impl.with_config(
    mosaic_tpu.MosaicTpuAttentionConfig(bwd_block_q=4)
  )._bwd_unsupported_reason(record)
  assert "runs on tpu, not on " in mosaic_tpu.MosaicTpuAttention().unsupported_reason(record)
  # The default choice falls back to another implementation instead.
  out = tokamax.dot_product_attention(
    q.astype(jnp.float16), kv.astype(jnp.float16), kv.astype(jnp.float16),
    implementation=[impl, "xla"],
  )  # fmt: skip
  assert out.shape == q.shape


def _record(b, t, s, n, k, h, dtype, **kwargs):
  shapes = ((b, t, n, h), (b, s, k, h), (b, s, k, h))
  structs = [jax.ShapeDtypeStruct(x, dtype) for x in shapes]
  return jax.eval_shape(lambda *a: spec.canonicalize(*a, **kwargs), *structs)


@pytest.mark.parametrize(("dtype", "block_q"), [("float32", 40), ("bfloat16", 48)])
def test_heuristic_blocks_of_a_short_sequence(dtype, block_q):
  """T=37 queries, below every query block: the one query candidate is T padded to whole
  sublanes (8 for float32, 16 for bfloat16), forward and backward; S=200 keys take one block of
  256 (S padded to whole 128 lanes: one grid step, not two of 128). The call runs with these
  blocks and matches the reference."""
  q, k, v, _ = _inputs(dict(b=1, t=37, s=200, n=2, k=1, h=64), dtype, seed=6)
  impl = mosaic_tpu.MosaicTpuAttention(interpret=True)
  record = spec.canonicalize(q, k, v)
  config = impl._get_heuristics_config(record)
  assert config == mosaic_tpu.MosaicTpuAttentionConfig(
    block_q=block_q, block_kv=256, bwd_block_q=block_q, bwd_block_kv=256
  )
  assert impl._unsupported_reason(record) is None
  out = tokamax.dot_product_attention(q, k, v, implementation=impl)
  ref = references.high_precision(references.attention)(q, k, v)
  assert compare.relative_error(out, ref) < _BOUND[dtype]


def test_autotuning_configs_pair_the_four_best_of_each_pass():
  """Autotuning times the forward's four best blocks with the backward's four best: sixteen
  configs, each one that both passes accept."""
  record = _record(2, 4096, 4096, 16, 16, 128, "bfloat16", is_causal=True)
  op = mosaic_tpu.MosaicTpuAttention()
  with export.abstract_tpu():
    configs = op._get_autotuning_configs(record)
    assert len(configs) == 16
    assert len({(c.block_q, c.block_kv) for c in configs}) == 4
    assert len({(c.bwd_block_q, c.bwd_block_kv) for c in configs}) == 4
    for c in configs:
      assert mosaic_tpu.config_reason(record, c) is None
      assert mosaic_tpu.bwd_config_reason(record, c) is None
    assert op._get_heuristics_config(record) in configs


@pytest.mark.parametrize("device_kind", ["TPU v5 lite", "TPU v5"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(
  ("shape", "causal"),
  [
    ((4, 4096, 4096, 32, 32, 128), False),
    ((2, 8192, 8192, 8, 8, 256), True),
    ((32, 2048, 2048, 16, 16, 64), False),
    # float32: the backward's best blocks (256 x 256) are not the forward's (512 x 512).
    ((1, 1024, 1000, 8, 8, 256), True),
  ],
)
def test_heuristic_blocks_fit_vmem(device_kind, dtype, shape, causal):
  record = _record(*shape, dtype, is_causal=causal)
  op = mosaic_tpu.MosaicTpuAttention()
  with export.abstract_tpu(device_kind):
    chip = tpu.chip()
    config = op._get_heuristics_config(record)
    assert mosaic_tpu.config_reason(record, config) is None
    assert mosaic_tpu.bwd_config_reason(record, config) is None
    for backward, blocks in ((False, config.block_q), (True, config.bwd_block_q)):
      block_kv = config.bwd_block_kv if backward else config.block_kv
      assert mosaic_tpu.vmem_bytes(record, blocks, block_kv, backward) <= chip.vmem_limit_bytes
      # The cost model's best among the blocks that fit, and at least 256 x 256.
      best = mosaic_tpu._ranked(record, backward)[0]
      assert (blocks, block_kv) == best
      assert blocks * block_kv >= 256 * 256
  assert chip.name == ("v5e" if device_kind == "TPU v5 lite" else "v5p")


def test_vmem_limit_is_the_target_chips():
  record = _record(1, 8192, 8192, 1, 1, 256, "float32")
  # Double-buffered q, k, v, out and log-sum-exp blocks; max, sum and accumulator; two
  # float32 [block_q, block_kv] tiles.
  rows, tile = 2048 * 128 * 4, 2048 * 1024 * 4
  blocks = (2048 * 256 + 2 * 1024 * 256 + 2048 * 256) * 4 + rows
  expected = 2 * blocks + 2 * rows + 2048 * 256 * 4 + 2 * tile
  assert mosaic_tpu.vmem_bytes(record, 2048, 1024, backward=False) == expected == 34 << 20
  config = mosaic_tpu.MosaicTpuAttentionConfig(block_q=2048, block_kv=1024)
  with export.abstract_tpu("TPU v5 lite"):  # 64 MiB of v5e's 128 MiB.
    assert mosaic_tpu.config_reason(record, config) is None
  with export.abstract_tpu("TPU v5"):  # 32 MiB of v5p's 64 MiB.
    assert "over the 33554432 used on v5p" in mosaic_tpu.config_reason(record, config)


def test_cost_model_counts_skipped_blocks():
  plain = _record(1, 4096, 4096, 8, 8, 128, "bfloat16")
  causal = _record(1, 4096, 4096, 8, 8, 128, "bfloat16", is_causal=True)
  window = _record(1, 4096, 4096, 8, 8, 128, "bfloat16", local_window_size=(256, 0))
  with export.abstract_tpu():
    times = [mosaic_tpu.estimated_seconds(r, 256, 256) for r in (plain, causal, window)]
  assert times[0] > times[1] > times[2]
  assert mosaic_tpu._visited_fraction(causal, 256, 256) == pytest.approx(136 / 256)


@pytest.mark.parametrize("backward", [False, True])
def test_cost_model_counts_by_hand(backward, roofline_calls):
  """B1 T300 S500 N2 H64 bfloat16 with 128 x 256 blocks: 3 query blocks, 2 key blocks, every
  pair visited; the flops, HBM bytes and grid steps handed to the chip's roofline."""
  record = _record(1, 300, 500, 2, 2, 64, "bfloat16")
  mosaic_tpu.estimated_seconds(record, 128, 256, backward=backward)
  pairs = 2 * 3 * 2
  flops = 2 * pairs * 128 * 256 * (64 + 64)
  q_bytes, kv_bytes = 128 * 128 * 2, 256 * 128 * 2  # q and out (or dout); k and v.
  if backward:  # Logits again, dS, dq, dk, dv; q-side and kv-side blocks read per pair, twice.
    expected = (2.5 * flops, pairs * (q_bytes + kv_bytes) * 2, pairs, 2)
  else:  # Key blocks per pair, query blocks once.
    expected = (flops, pairs * kv_bytes + 2 * 3 * q_bytes, pairs, 2)
  assert roofline_calls == [expected]


def test_cost_model_visits_the_causal_triangle(roofline_calls):
  """T = S = 512 causal with 128-row blocks: query block i sees key blocks 0..i, 10 of 16;
  the work counts the 10, the grid steps all 16 (skipped blocks still take a step)."""
  causal = _record(1, 512, 512, 1, 1, 64, "bfloat16", is_causal=True)
  assert mosaic_tpu._visited_fraction(causal, 128, 128) == 10 / 16
  mosaic_tpu.estimated_seconds(causal, 128, 128)
  assert [(flops, steps) for flops, _, steps, _ in roofline_calls] == [
    (2 * 10 * 128 * 128 * 128, 16)
  ]


def test_backward_blocks_checked_against_the_backwards_vmem():
  """2048 x 2048 float32 blocks at H=256: the forward's two float32 [block_q, block_kv]
  temporaries and its blocks fit v5e's 64 MiB; the backward's four temporaries alone take
  64 MiB, so its blocks (and only they) are refused."""
  record = _record(1, 8192, 8192, 1, 1, 256, "float32")
  config = mosaic_tpu.MosaicTpuAttentionConfig(
    block_q=2048, block_kv=2048, bwd_block_q=2048, bwd_block_kv=2048
  )
  with export.abstract_tpu("TPU v5 lite"):
    assert mosaic_tpu.config_reason(record, config) is None
    reason = mosaic_tpu.bwd_config_reason(record, config)
  assert reason is not None and "bwd_blocks need" in reason and "over the 67108864" in reason
  assert mosaic_tpu.vmem_bytes(record, 2048, 2048, backward=True) > 4 * 2048 * 2048 * 4


def test_logits_far_below_zero():
  """A bias that puts every logit near -150 (exp underflows to 0 in float32): the softmax is
  the same as without it, since the running maximum starts at -inf, not 0. The bound allows
  for float32 logits of that size (spacing 1.5e-5)."""
  q, k, v, rng = _inputs(dict(b=1, t=16, s=200, n=2, k=1, h=64), "float32")
  bias = jnp.asarray(rng.standard_normal((1, 1, 1, 200)) - 150.0, jnp.float32)
  config = mosaic_tpu.MosaicTpuAttentionConfig(block_q=8, block_kv=128)
  impl = mosaic_tpu.MosaicTpuAttention(interpret=True, config=config)
  out = tokamax.dot_product_attention(q, k, v, bias, implementation=impl)
  ref = references.high_precision(references.attention)(q, k, v, bias)
  assert compare.relative_error(out, ref) < 1e-4


def test_vmem_counts_the_plane_blocks():
  """A bias broadcast in T ([1, N, 1, S]: a [1, block_kv] block) and a full mask ([B, 1, T,
  S]: [block_q, block_kv]) add their double-buffered float32/int32 blocks to the forward's
  and the backward's VMEM."""
  b, t, s, n, h = 2, 1024, 1024, 4, 128
  plain = _record(b, t, s, n, n, h, "bfloat16")
  structs = [jax.ShapeDtypeStruct(x, jnp.bfloat16) for x in ((b, t, n, h), (b, s, n, h))]
  bias = jax.ShapeDtypeStruct((1, n, 1, s), jnp.float32)
  mask = jax.ShapeDtypeStruct((b, 1, t, s), jnp.bool_)
  with_planes = jax.eval_shape(
    lambda q, k, bias, mask: spec.canonicalize(q, k, k, bias, mask), *structs, bias, mask
  )
  for bq, bk in ((128, 256), (256, 512)):
    planes = 2 * (bk * 4 + bq * bk * 4)
    for backward in (False, True):
      got = mosaic_tpu.vmem_bytes(with_planes, bq, bk, backward)
      assert got - mosaic_tpu.vmem_bytes(plain, bq, bk, backward) == planes, (bq, bk, backward)


def test_vmem_counts_a_plane_broadcast_over_the_keys():
  """A bias broadcast in S ([B, N, T, 1]: a [block_q, 1] block) adds its double-buffered
  float32 block, 2 * block_q * 4 bytes, to the forward's and the backward's VMEM."""
  b, t, s, n, h = 2, 1024, 1024, 4, 128
  plain = _record(b, t, s, n, n, h, "bfloat16")
  structs = [jax.ShapeDtypeStruct(x, jnp.bfloat16) for x in ((b, t, n, h), (b, s, n, h))]
  bias = jax.ShapeDtypeStruct((b, n, t, 1), jnp.float32)
  with_bias = jax.eval_shape(lambda q, k, bias: spec.canonicalize(q, k, k, bias), *structs, bias)
  for bq, bk in ((128, 256), (256, 512)):
    for backward in (False, True):
      got = mosaic_tpu.vmem_bytes(with_bias, bq, bk, backward)
      assert got - mosaic_tpu.vmem_bytes(plain, bq, bk, backward) == 2 * bq * 4, (bq, bk)


def test_backward_vmem_counts_by_hand():
  """The backward's VMEM, bfloat16 with H=64 and hv=128 (so that the key and value sides
  differ): double-buffered q and dout [block_q, H|hv], k and v [block_kv, H|hv], the float32
  lane-replicated log-sum-exp and delta [block_q, 128] blocks in; double-buffered dk and dv
  out, their float32 accumulators; four float32 [block_q, block_kv] temporaries (logits,
  probabilities and their two cotangents)."""
  b, t, s, n, h, hv = 1, 2048, 2048, 2, 64, 128
  shapes = ((b, t, n, h), (b, s, n, h), (b, s, n, hv))
  structs = [jax.ShapeDtypeStruct(x, jnp.bfloat16) for x in shapes]
  record = jax.eval_shape(spec.canonicalize, *structs)
  for bq, bk in ((128, 256), (512, 128)):
    q_side = bq * (h + hv) * 2 + 2 * bq * 128 * 4  # q, dout; lse, delta.
    kv_side = bk * (h + hv) * 2  # k, v.
    outputs = bk * (h + hv) * 2  # dk, dv.
    accumulators = bk * (h + hv) * 4
    temporaries = 4 * bq * bk * 4
    want = 2 * (q_side + kv_side + outputs) + accumulators + temporaries
    assert mosaic_tpu.vmem_bytes(record, bq, bk, backward=True) == want, (bq, bk)


def _assert_vjp_matches_reference(q, k, v, rng, kwargs, config):
  """Output and gradients (random cotangent) of the interpreted kernels with `config`
  against the float64 reference, in float32."""
  impl = mosaic_tpu.MosaicTpuAttention(interpret=True, config=config)
  out, vjp = jax.vjp(
    lambda *a: tokamax.dot_product_attention(*a, implementation=impl, **kwargs), q, k, v
  )
  ct = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
  ref, ref_grads = references.high_precision_vjp(
    lambda *a: references.attention(*a, **kwargs), (q, k, v), ct
  )
  for label, x, r in zip(
    ("out", "dq", "dk", "dv"), (out, *vjp(ct)), (ref, *ref_grads), strict=True
  ):
    assert compare.relative_error(x, r) < _BOUND["float32"], label


def test_causal_sliding_window_with_a_scale_matches_reference():
  """Causal attention with a local window (a sliding window: key j visible to query i for
  i - 37 <= j <= i) and a logit scale of 0.3, forward and gradients. Both masks meet inside
  the partly hidden blocks: a key must be on the visible side of the diagonal and inside the
  window, so neither may stand in for the other."""
  q, k, v, rng = _inputs(dict(b=1, t=64, s=160, n=2, k=1, h=64), "float32", seed=12)
  kwargs = dict(is_causal=True, local_window_size=(37, 5), scale=0.3)
  config = mosaic_tpu.MosaicTpuAttentionConfig(
    block_q=8, block_kv=128, bwd_block_q=16, bwd_block_kv=128
  )
  _assert_vjp_matches_reference(q, k, v, rng, kwargs, config)


def test_lengths_longer_in_a_later_batch_match_reference():
  """Per-batch lengths where the second batch sees more than the first (20 and 48 query rows,
  40 and 190 keys): the key and query blocks a batch visits, and those its index maps fetch,
  follow that batch's own lengths, forward and gradients."""
  q, k, v, rng = _inputs(dict(b=2, t=48, s=200, n=2, k=1, h=64), "float32", seed=13)
  kwargs = dict(
    query_seq_lengths=jnp.array([20, 48], jnp.int32),
    key_value_seq_lengths=jnp.array([40, 190], jnp.int32),
  )
  config = mosaic_tpu.MosaicTpuAttentionConfig(
    block_q=8, block_kv=128, bwd_block_q=8, bwd_block_kv=128
  )
  _assert_vjp_matches_reference(q, k, v, rng, kwargs, config)


def test_backward_kernels_take_the_backward_blocks(monkeypatch):
  """The forward kernel runs with block_q x block_kv, the dq and dk/dv kernels with
  bwd_block_q x bwd_block_kv (the blocks their own VMEM check passed), and the gradients
  match the reference."""
  seen = {}

  def spy(name, fn, position):
    def wrapped(*args, **kwargs):
      p = args[position]
      seen[name] = (p.block_q, p.block_kv)
      return fn(*args, **kwargs)

    return wrapped

  monkeypatch.setattr(mosaic_tpu_kernel, "forward", spy("fwd", mosaic_tpu_kernel.forward, 6))
  monkeypatch.setattr(mosaic_tpu_kernel, "backward", spy("bwd", mosaic_tpu_kernel.backward, 9))
  q, k, v, rng = _inputs(dict(b=1, t=40, s=300, n=2, k=1, h=64), "float32", seed=14)
  config = mosaic_tpu.MosaicTpuAttentionConfig(
    block_q=8, block_kv=256, bwd_block_q=16, bwd_block_kv=128
  )
  impl = mosaic_tpu.MosaicTpuAttention(interpret=True, config=config)
  out, vjp = jax.vjp(lambda *a: tokamax.dot_product_attention(*a, implementation=impl), q, k, v)
  ct = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
  grads = vjp(ct)
  assert seen == {"fwd": (8, 256), "bwd": (16, 128)}
  ref, ref_grads = references.high_precision_vjp(references.attention, (q, k, v), ct)
  for label, x, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads), strict=True):
    assert compare.relative_error(x, r) < _BOUND["float32"], label
