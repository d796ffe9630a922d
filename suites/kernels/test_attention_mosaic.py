"""Mosaic GPU attention (`implementation="mosaic"`).

On CPU: the kernels run in the Pallas Mosaic GPU interpreter with race detection
on small shapes (each case in a subprocess, see `_run_case`), and every tuning
config lowers for CUDA. What the interpreter cannot run, so the compiled kernel
differs there: `pl.run_state` with a preloaded wgmma accumulator and wgmma with
its A operand in registers (the P.V, dS.K, P^T.dO and dS^T.Q products); in
interpret mode those operands are staged through shared memory and the product
is added to the accumulator; with `overlap_qk` the forward's output accumulator,
which the compiled kernel keeps in wgmma registers across steps, is such a value
too (and the interpreter runs wgmma synchronously, so it cannot see the overlap's
`wgmma_wait` counts). `setmaxnreg`, the real shared-memory limit and the
ptxas compile need the GPU (ci/gpu/attention_mosaic.py, and the GPU tests here).

The interpreter reports races on the dk/dv kernel's register loads of the
streamed log-sum-exp and delta slots (it also reported them on a register load
of the value slots, before the forward kernel staged P through wgmma instead):
each load is followed by the slot's release barrier, so they are accepted here
as the only races allowed, and nothing else may race.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from suites import opdb
from suites.opdb import kernel_cases
from tokamax._src import device
from tokamax._src.ops import op
from tokamax._src.ops.attention import mosaic, mosaic_bwd, mosaic_common, spec, xla
from tokamax_harness import references

# The summary counts these under the op and implementation they check.
pytestmark = pytest.mark.op("dot_product_attention", "mosaic")

_HERE = os.path.abspath(__file__)
# A producer TMA write against a consumer register load of one [block_q] float32
# slot (the dk/dv kernel's log-sum-exp and delta slots; under `jax.grad` the
# interpreter names the custom_vjp frame rather than the kernel line).
_KNOWN_RACE = re.compile(
  r"write of HostAllocationKey\([^)]*\)\[\(\d+, slice\(0, (32|64|128), 1\)\)\] from "
  r"Warpgroup\([^)]*warpgroup_id=2\)"
)


def _inputs(seed, b, t, s, n, kh, h, dtype):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (b, s, kh, h), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (b, s, kh, h), jnp.float32).astype(dtype)
  do = jax.random.normal(ks[3], (b, t, n, h), jnp.float32)
  return q, k, v, do


def _rel_err(x, ref) -> float:
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  scale = np.linalg.norm(ref)
  return float(np.linalg.norm(x - ref) / scale) if scale else float(np.abs(x).max())


def _compare(impl, shape, dtype, grads, seed=0, **kw) -> dict:
  """Output and gradient errors of `impl` against XLA on float32-upcast inputs."""
  q, k, v, do = _inputs(seed, *shape, dtype)
  up = [x.astype(jnp.float32) for x in (q, k, v)]
  ref_impl = xla.XlaAttention()
  hi = jax.lax.Precision.HIGHEST
  out = impl(q, k, v, **kw)
  ref = ref_impl(*up, precision=hi, **kw)
  res = {"out": _rel_err(out.astype(jnp.float32), ref), "finite": bool(jnp.isfinite(out).all())}
  res["dtypes"] = [str(out.dtype)]
  if grads:

    def loss(f, **extra):
      return lambda q, k, v: jnp.sum(f(q, k, v, **kw, **extra).astype(jnp.float32) * do)

    g = jax.grad(loss(impl), argnums=(0, 1, 2))(q, k, v)
    gr = jax.grad(loss(ref_impl, precision=hi), argnums=(0, 1, 2))(*up)
    res["grads"] = [_rel_err(a.astype(jnp.float32), r) for a, r in zip(g, gr, strict=True)]
    res["dtypes"] += [str(a.dtype) for a in g]
    # A bias constant over the keys has a zero gradient (the softmax ignores a shift
    # of its row), so only a bias that varies over them has one to compare.
    if kw.get("bias") is not None and kw["bias"].shape[-1] > 1:
      res["grads"].append(
        _rel_err(
          _bias_grad(impl, (q, k, v), do, kw), _bias_grad(ref_impl, up, do, kw, precision=hi)
        )
      )
  return res


def _bias_grad(impl, qkv, do, kw, **extra):
  def loss(bias):
    return jnp.sum(impl(*qkv, **{**kw, "bias": bias}, **extra).astype(jnp.float32) * do)

  return jax.grad(loss)(kw["bias"])


def _mask(seed, shape, p=0.7, dead_rows=0.2):
  """A random mask [B|1, N|1, T|1, S|1] with a `dead_rows` share of its rows all False."""
  keep, live = jax.random.split(jax.random.key(seed))
  mask = jax.random.bernoulli(keep, p, shape)
  return mask & jax.random.bernoulli(live, 1.0 - dead_rows, (*shape[:3], 1))


# name -> `kernel_cases.AttentionKernelCase` (in the op database).
CASES = opdb.get("dot_product_attention").kernel_cases["mosaic"]


def _shape(case) -> tuple[int, ...]:
  """(B, T, S, N, K, H) of a case."""
  return tuple(case.shape[x] for x in "btsnkh")


def _kwargs(features: dict) -> dict:
  """A case's keyword arguments, with its bias and mask planes drawn and lengths as arrays."""
  kw = {}
  for name, value in features.items():
    if isinstance(value, kernel_cases.RandomBias):
      value = value.draw()
    elif isinstance(value, kernel_cases.RandomMask):
      value = _mask(value.seed, value.shape, value.p, value.dead_rows)
    elif name.endswith("seq_lengths"):
      value = jnp.array(value)
    kw[name] = value
  return kw


# The cases whose mask, or bias with -inf rows, may hide whole query rows.
_EXTRA_CASES = [
  name
  for name, case in CASES.items()
  if "mask" in case.features or getattr(case.features.get("bias"), "dead_rows", 0)
]


def _case_main(name: str) -> None:
  """Runs one interpret case and prints its result as JSON (subprocess entry)."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

  case = CASES[name]
  impl = mosaic.interpret_op()
  if case.config:
    impl = mosaic.MosaicAttention(
      interpret=True, config=mosaic.MosaicAttentionConfig(**case.config)
    )
  res = _compare(impl, _shape(case), jnp.dtype(case.dtype), case.grads, **_kwargs(case.features))
  res["races_found_last_kernel"] = bool(interpret_pallas_call.get_races().races_found)
  print("RESULT " + json.dumps(res), flush=True)


def _run_case(name: str, timeout: float = 600) -> tuple[dict, str]:
  # The interpreter runs each CTA's three warpgroups as threads that block on
  # one another inside XLA's CPU runtime; with the default pool (one thread per
  # core) a 2-core machine deadlocks, so the case runs in a fresh process with
  # a larger pool.
  env = dict(os.environ, PJRT_NPROC="8", JAX_PLATFORMS="cpu")
  root = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
  env["PYTHONPATH"] = os.pathsep.join([os.path.join(root, "src"), root, env.get("PYTHONPATH", "")])
  proc = subprocess.run(
    [sys.executable, _HERE, name],
    capture_output=True,
    text=True,
    env=env,
    timeout=timeout,
    check=False,
  )
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
  assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
  return json.loads(lines[-1][len("RESULT ") :]), proc.stdout


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.host_only
def test_interpret_matches_xla(name):
  # A forward case runs in seconds; one that hangs (a consumer waiting on a key block the
  # producer never copies, e.g. a step loop that takes a block twice) fails in 150 s (with
  # gradients, whose slowest case takes ~30 s on CI, 240 s).
  timeout = 240 if CASES[name].grads else 150
  try:
    res, stdout = _run_case(name, timeout=timeout)
  except subprocess.TimeoutExpired:
    pytest.fail(f"{name} ran past {timeout} s: a consumer waits on a copy never made")
  # The output and the gradients of query, key and value keep the input dtype.
  assert set(res["dtypes"]) == {CASES[name].dtype}, res
  assert res["finite"]
  assert res["out"] < 1e-2, res
  if "grads" in res:
    assert max(res["grads"]) < 1e-2, res
  races = stdout.split("RACE DETECTED")[1:]
  for race in races:
    assert _KNOWN_RACE.search(race), race
  if not CASES[name].grads:  # Forward only: no race at all.
    assert not races and not res["races_found_last_kernel"]


def _positional(masking, rows, cols, q_len, kv_len):
  """Visibility [rows, cols] of query ids `rows` to key ids `cols` (the harness's table)."""
  ok = references.positional_visibility(
    rows, cols, is_causal=masking.causal, local_window_size=masking.window
  )
  return ok & (np.asarray(cols)[None, :] < kv_len) & (np.asarray(rows)[:, None] < q_len)


def _check_ranges(ranges, blocks, num, visible_block):
  """[lo, hi) holds every block with a visible pair; [full_lo, full_hi) only all-visible ones."""
  lo, full_lo, full_hi, hi = (int(x) for x in ranges)
  assert 0 <= lo <= full_lo <= full_hi <= hi <= num, ranges
  for blk in range(num):
    ok = visible_block(blk * blocks + np.arange(blocks))
    if ok.any():
      assert lo <= blk < hi, (blk, ranges)
    if full_lo <= blk < full_hi:
      assert ok.all(), (blk, ranges)


_BLOCK_MASKINGS = [
  mosaic_common.Masking(causal=True),
  mosaic_common.Masking(window=(17, 1)),
  mosaic_common.Masking(window=(1, 17), kv_len=True),
  mosaic_common.Masking(causal=True, window=(16, 0), q_len=True, kv_len=True),
  mosaic_common.Masking(window=(0, 15), q_len=True),
  mosaic_common.Masking(window=(30, 30), kv_len=True),
  mosaic_common.Masking(q_len=True, kv_len=True),
]


def _check_block_ranges(masking, t: int, s: int, held: int, streamed: int, seed: int, check=None):
  """`kv_blocks` and `q_blocks` for each held block of `held` rows (or keys) against a
  brute-force visibility table over streamed blocks of `streamed`, at random lengths, by
  `check` (default `_check_ranges`)."""
  check = check or _check_ranges
  rng = np.random.default_rng(seed)
  for _ in range(4):
    q_len = int(rng.integers(0, t + 1)) if masking.q_len else t
    kv_len = int(rng.integers(0, s + 1)) if masking.kv_len else s
    for r0 in range(0, t, held):
      rows = r0 + np.arange(held)
      ranges = mosaic_common.kv_blocks(masking, r0, held, streamed, s // streamed, kv_len)
      # kv_blocks sees no query length: rows past it are dropped elsewhere.
      check(
        ranges, streamed, s // streamed, lambda cols: _positional(masking, rows, cols, t, kv_len)
      )
    for c0 in range(0, s, held):
      cols = c0 + np.arange(held)
      ranges = mosaic_common.q_blocks(masking, c0, held, streamed, t // streamed, q_len, kv_len)
      check(ranges, streamed, t // streamed, lambda r: _positional(masking, r, cols, q_len, kv_len))


@pytest.mark.parametrize("masking", _BLOCK_MASKINGS, ids=lambda m: repr(m)[8:].replace(" ", ""))
def test_block_ranges_hold_every_visible_pair(masking):
  """`kv_blocks` and `q_blocks` (the key and query blocks the kernels visit, and those they
  visit without masks) against a brute-force visibility table, at 16-row blocks whose
  windows end on block boundaries and at random sequence lengths."""
  _check_block_ranges(masking, t=64, s=80, held=16, streamed=16, seed=3)


@pytest.mark.parametrize(("held", "streamed"), [(16, 32), (32, 16), (8, 32)])
@pytest.mark.parametrize("masking", _BLOCK_MASKINGS, ids=lambda m: repr(m)[8:].replace(" ", ""))
def test_block_ranges_at_unequal_blocks(masking, held, streamed):
  """As `test_block_ranges_hold_every_visible_pair`, with held blocks of another size than
  the streamed ones (the forward holds 64 query rows against 128 or 256 keys; the dk/dv
  kernel 64 keys against 128 query rows): a held block may then start or end inside a
  streamed block, and a rounding of the wrong way drops that block."""
  _check_block_ranges(masking, t=96, s=128, held=held, streamed=streamed, seed=5)


@pytest.mark.parametrize("masking", _BLOCK_MASKINGS, ids=lambda m: repr(m)[8:].replace(" ", ""))
def test_block_ranges_at_odd_blocks(masking):
  """As `test_block_ranges_hold_every_visible_pair`, at held blocks of 3 rows (or keys)
  against streamed blocks of 8: a held block's last row then falls on the first row of a
  streamed block (row 8, 32, ...), which the kernels' even block sizes never reach, and a
  range rounded one row short there drops that streamed block."""
  _check_block_ranges(masking, t=48, s=48, held=3, streamed=8, seed=9)


# Maskings whose visible blocks, and all-visible blocks, of a held block are contiguous and
# found exactly by the block ranges (a window with lengths may leave a range that sees
# nothing: sound, but not tight).
_TIGHT_MASKINGS = [
  mosaic_common.Masking(causal=True),
  mosaic_common.Masking(window=(17, 1)),
  mosaic_common.Masking(window=(0, 15)),
  mosaic_common.Masking(window=(30, 30)),
  # A window edge one key short of a block edge: all-visible blocks start or end there.
  mosaic_common.Masking(window=(15, 40)),
  mosaic_common.Masking(window=(40, 15)),
  mosaic_common.Masking(causal=True, window=(40, 0)),
  mosaic_common.Masking(causal=True, window=(5, 3)),
  mosaic_common.Masking(kv_len=True),
  mosaic_common.Masking(q_len=True, kv_len=True),
  mosaic_common.Masking(causal=True, kv_len=True),
]


def _check_tight(ranges, blocks, num, visible_block):
  """[lo, hi) is exactly the first to the last block with a visible pair (empty if none),
  and [full_lo, full_hi) the first to the last all-visible block (empty if none)."""
  lo, full_lo, full_hi, hi = (int(x) for x in ranges)
  tables = [visible_block(blk * blocks + np.arange(blocks)) for blk in range(num)]
  some = [blk for blk, ok in enumerate(tables) if ok.any()]
  full = [blk for blk, ok in enumerate(tables) if ok.all()]
  if some:
    assert (lo, hi) == (some[0], some[-1] + 1), (ranges, some)
  else:
    assert lo == hi, ranges
  if full:
    assert (full_lo, full_hi) == (full[0], full[-1] + 1), (ranges, full)
  else:
    assert full_lo == full_hi, ranges


@pytest.mark.parametrize(("held", "streamed"), [(16, 16), (16, 32), (32, 16), (8, 32)])
@pytest.mark.parametrize("masking", _TIGHT_MASKINGS, ids=lambda m: repr(m)[8:].replace(" ", ""))
def test_block_ranges_visit_no_block_that_sees_nothing(masking, held, streamed):
  """The kernels visit no streamed block in which the held block sees nothing, and run every
  all-visible block unmasked: `kv_blocks` and `q_blocks` are exact for these maskings,
  against the brute-force visibility table at random lengths (a looser range gives the same
  numbers, only slower, so the numerical tests cannot see it)."""
  _check_block_ranges(
    masking, t=96, s=128, held=held, streamed=streamed, seed=7, check=_check_tight
  )


@pytest.mark.parametrize("masking", _BLOCK_MASKINGS, ids=lambda m: repr(m)[8:].replace(" ", ""))
def test_visible_matches_the_positional_table_and_lengths(masking):
  """`visible` (the elementwise mask of the kernels' masked steps) against the harness's
  positional table and the lengths: query rows at or past q_len and keys at or past kv_len
  see nothing, at lengths that fall inside the id ranges and at their ends."""
  rows, cols = np.arange(48), np.arange(56)
  q_ids = jnp.asarray(np.broadcast_to(rows[:, None], (48, 56)), jnp.int32)
  k_ids = jnp.asarray(np.broadcast_to(cols[None, :], (48, 56)), jnp.int32)
  rng = np.random.default_rng(11)
  for q_len, kv_len in [(0, 0), (48, 56), (1, 1), *rng.integers(1, 48, (4, 2))]:
    q_len = int(q_len) if masking.q_len else 48
    kv_len = int(kv_len) if masking.kv_len else 56
    got = mosaic_common.visible(masking, q_ids, k_ids, jnp.int32(q_len), jnp.int32(kv_len))
    want = _positional(masking, rows, cols, q_len, kv_len)
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{q_len=} {kv_len=}")
  assert mosaic_common.visible(mosaic_common.Masking(), q_ids, k_ids, 48, 56) is None


@pytest.mark.parametrize(
  ("dtype", "minor", "contracted", "tiling", "swizzle"),
  [
    (jnp.bfloat16, 64, None, 64, 128),  # A 128-byte row: the full swizzle.
    (jnp.bfloat16, 128, None, 64, 128),  # Wider rows keep 128 bytes.
    (jnp.bfloat16, 32, None, 32, 64),  # A 64-byte row.
    (jnp.bfloat16, 256, 32, 32, 64),  # Wide rows, but a product contracting 32 elements.
    (jnp.bfloat16, 256, 128, 64, 128),
    (jnp.float32, 64, None, 32, 128),
    (jnp.int8, 64, None, 64, 64),  # A staged mask tile of 64 keys.
    (jnp.int8, 128, None, 128, 128),
  ],
)
def test_smem_transforms_take_the_widest_swizzle_a_row_and_the_contraction_allow(
  dtype, minor, contracted, tiling, swizzle
):
  """The swizzle is the largest of 32, 64 and 128 bytes within a row and within the
  contraction; the tiling is 8 rows by one swizzle's worth of elements."""
  tile, swz = mosaic_common.smem_transforms(dtype, minor, contracted)
  assert tile.tiling == (8, tiling) and swz.swizzle == swizzle


def _on_grid(fn, axes):
  """`fn()` evaluated at every index of named grid `axes` ((name, size), outermost first)."""
  for name, size in reversed(axes):
    fn = (lambda f, name, size: lambda: jax.vmap(lambda _: f(), axis_name=name)(jnp.zeros(size)))(
      fn, name, size
    )
  return fn()


@pytest.mark.parametrize(
  "masking",
  [
    mosaic_common.Masking(causal=True, q_len=True, kv_len=True),
    mosaic_common.Masking(causal=True, window=(70, 0)),
  ],
  ids=lambda m: repr(m)[8:].replace(" ", ""),
)
def test_query_tile_takes_the_heaviest_tiles_first(masking):
  """`query_tile` on a grid of 2 batches, 4 query tiles and 4 heads (GQA groups of 2): grid
  index i holds the query tile i-th from the end (under a causal mask the later rows see the
  most keys, so those CTAs start first), each batch's lengths, the key/value head of its
  group, and the key blocks any of its rows sees (brute force; query lengths do not narrow
  them)."""
  t, s, block_q, block_kv = 256, 192, 32, 64
  lengths = jnp.array([[200, 50], [150, 30]], jnp.int32)

  def fn():
    qt = mosaic_common.query_tile(
      masking, lengths, t=t, s_len=s, groups=2, block_q=block_q, block_kv=block_kv, consumers=2
    )
    return qt.r0, qt.lo, qt.hi, qt.q_len, qt.kv_len, qt.head, qt.kv_head, qt.batch

  out = _on_grid(fn, (("batch", 2), ("q_tiles", 4), ("heads", 4)))
  r0, lo, hi, q_len, kv_len, head, kv_head, batch = (np.asarray(x) for x in out)
  for b, i, n in np.ndindex(2, 4, 4):
    at = (b, i, n)
    want_q_len = int(lengths[0, b]) if masking.q_len else t
    want_kv_len = int(lengths[1, b]) if masking.kv_len else s
    want_r0 = (t // 64 - 1 - i) * 64
    assert (r0[at], head[at], kv_head[at], batch[at]) == (want_r0, n, n // 2, b), at
    assert (q_len[at], kv_len[at]) == (want_q_len, want_kv_len), at
    rows = want_r0 + np.arange(64)
    seen = [
      blk
      for blk in range(s // block_kv)
      if _positional(masking, rows, blk * block_kv + np.arange(block_kv), t, want_kv_len).any()
    ]
    assert (lo[at], hi[at]) == (seen[0], seen[-1] + 1), (at, lo[at], hi[at], seen)


def _lower(impl, config, shape, dtype=jnp.bfloat16, grads=False, **kw):
  b, t, s, n, kh, h = shape
  sds = jax.ShapeDtypeStruct

  def f(q, k, v, do):
    record = spec.canonicalize(q, k, v, **kw)
    out, residuals = impl._fwd(record, config)
    if not grads:
      return out
    return impl._bwd(record, config, out, residuals, do)

  args = (sds((b, t, n, h), dtype), sds((b, s, kh, h), dtype), sds((b, s, kh, h), dtype))
  return jax.jit(f).trace(*args, sds((b, t, n, h), dtype)).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("h", [64, 128, 256])
def test_every_autotuning_config_lowers_for_cuda(h):
  """Each distinct forward config lowers, and the backward at each dq and dk/dv block shape."""
  impl = mosaic.MosaicAttention()
  shape = (2, 512, 512, 4, 2, h)
  record = spec.canonicalize(
    *(jnp.zeros(s, jnp.bfloat16) for s in ((2, 512, 4, h), (2, 512, 2, h), (2, 512, 2, h)))
  )
  configs = impl._get_autotuning_configs(record)
  assert impl._get_heuristics_config(record) in configs
  fwd_fields = ("block_kv", "num_stages", "schedule_barrier", "fwd_consumers")
  forwards, dq_blocks, dkv_blocks = set(), set(), set()
  for config in sorted(configs, key=str):
    assert mosaic.smem_bytes(config, h) <= mosaic._SMEM_BYTES
    assert mosaic.bwd_config_reason(config, h) is None
    fwd = tuple(getattr(config, f) for f in fwd_fields)
    if fwd not in forwards:
      forwards.add(fwd)
      assert "mosaic_gpu" in _lower(impl, config, shape, is_causal=True).as_text()
    dq, dkv = (config.dq_block_q, config.dq_block_kv), (config.bwd_block_q, config.bwd_block_kv)
    if dq not in dq_blocks or dkv not in dkv_blocks:
      dq_blocks.add(dq)
      dkv_blocks.add(dkv)
      _lower(impl, config, shape, grads=True, local_window_size=(64, 0))
  # The backward blocks the registers allow (`mosaic.bwd_registers`).
  assert (sorted(dq_blocks), sorted(dkv_blocks)) == {
    64: (
      [(64, 32), (64, 64), (64, 128), (128, 32), (128, 64)],
      [(32, 64), (32, 128), (64, 64), (128, 64)],
    ),
    128: ([(64, 32), (64, 64), (64, 128), (128, 32)], [(32, 64), (64, 64)]),
    256: ([(64, 32), (64, 64)], [(32, 64), (64, 64)]),
  }[h]


def test_lowers_with_every_feature_for_cuda():
  impl = mosaic.MosaicAttention()
  lengths = dict(query_seq_lengths=jnp.array([3, 5]), key_value_seq_lengths=jnp.array([7, 0]))
  _lower(
    impl,
    mosaic.MosaicAttentionConfig(),
    (2, 200, 300, 4, 1, 64),
    jnp.float16,
    grads=True,
    is_causal=True,
    local_window_size=(50, 10),
    logits_soft_cap=3.0,
    **lengths,
  )


@pytest.mark.parametrize(
  ("h", "bwd_block_q", "kernel"),
  [
    (64, 64, "attention_dk_dv_dq"),
    (64, 128, "attention_dk_dv_dq"),
    (128, 64, "attention_dk_dv_dq"),
  ],
)
def test_atomic_dq_backward_lowers_for_cuda_without_a_dq_kernel(h, bwd_block_q, kernel):
  """deterministic_bwd=False: the dk/dv kernel forms dq by TMA reduce-adds; no dq kernel runs."""
  impl = mosaic.MosaicAttention()
  config = mosaic.MosaicAttentionConfig(
    block_kv=64, deterministic_bwd=False, bwd_block_q=bwd_block_q
  )
  assert mosaic.bwd_config_reason(config, h) is None
  lengths = dict(query_seq_lengths=jnp.array([3, 50]), key_value_seq_lengths=jnp.array([70, 0]))
  shape = (2, 200, 300, 4, 2, h)
  window = dict(local_window_size=(150, 0), logits_soft_cap=3.0)
  text = _lower(impl, config, shape, grads=True, **window, **lengths)
  kernels = set(re.findall(r"attention_d[a-z_]*", text.as_text()))
  assert kernel in kernels and "attention_dq" not in kernels, kernels
  deterministic = _lower(
    impl, dataclasses.replace(config, deterministic_bwd=True), shape, grads=True
  )
  assert "attention_dq" in set(re.findall(r"attention_d[a-z_]*", deterministic.as_text()))


@pytest.mark.parametrize("h", [64, 128])
def test_atomic_dq_is_not_taken_with_a_causal_mask(h):
  """deterministic_bwd=False under a causal mask runs the deterministic kernels (the one
  kernel measured 1.23x their time at head dim 128)."""
  impl = mosaic.MosaicAttention()
  config = mosaic.MosaicAttentionConfig(deterministic_bwd=False)
  assert not mosaic.forms_dq_in_dkv(config, h, causal=True) and mosaic.forms_dq_in_dkv(config, h)
  text = _lower(impl, config, (2, 200, 300, 4, 2, h), grads=True, is_causal=True)
  kernels = set(re.findall(r"attention_d[a-z_]*", text.as_text()))
  assert {"attention_dq", "attention_dk_dv"} <= kernels, kernels
  assert "attention_dk_dv_dq" not in kernels, kernels


def test_atomic_dq_is_not_taken_at_head_dim_256():
  """deterministic_bwd=False at head dim 256 runs the deterministic kernels (the dk pass
  forming dq measured slower than them)."""
  impl = mosaic.MosaicAttention()
  q = jnp.ones((1, 8, 2, 256), jnp.bfloat16)
  config = impl._get_heuristics_config(spec.canonicalize(q, q, q))
  fast = dataclasses.replace(config, deterministic_bwd=False)
  assert not mosaic.forms_dq_in_dkv(fast, 256) and mosaic.forms_dq_in_dkv(fast, 128)
  text = _lower(impl, fast, (2, 200, 300, 4, 2, 256), grads=True, is_causal=True)
  kernels = set(re.findall(r"attention_d[a-z_]*", text.as_text()))
  assert kernels >= {"attention_dq", "attention_dk", "attention_dv"}, kernels


@pytest.mark.parametrize(("h", "block_kv"), [(64, 64), (64, 128), (128, 64), (128, 128), (256, 64)])
def test_overlap_qk_lowers_for_cuda(h, block_kv):
  impl = mosaic.MosaicAttention()
  lengths = dict(query_seq_lengths=jnp.array([3, 50]), key_value_seq_lengths=jnp.array([70, 0]))
  for sched in (True, False):
    config = mosaic.MosaicAttentionConfig(
      block_kv=block_kv, overlap_qk=True, schedule_barrier=sched
    )
    assert mosaic.smem_bytes(config, h) <= mosaic._SMEM_BYTES
    kw = dict(is_causal=True, local_window_size=(50, 10), logits_soft_cap=3.0, **lengths)
    _lower(impl, config, (2, 200, 300, 4, 2, h), jnp.float16, **kw)


@pytest.mark.parametrize(("h", "block_kv"), [(64, 64), (64, 128), (128, 64)])
def test_three_consumers_lower_for_cuda(h, block_kv):
  """fwd_consumers=3: T 300 pads to 320, a whole tile of 192 rows and a partial one."""
  impl = mosaic.MosaicAttention()
  config = mosaic.MosaicAttentionConfig(block_kv=block_kv, fwd_consumers=3, schedule_barrier=False)
  lengths = dict(key_value_seq_lengths=jnp.array([70, 0]))
  text = _lower(impl, config, (2, 300, 300, 4, 2, h), is_causal=True, **lengths).as_text()
  assert "attention" in text


@pytest.mark.parametrize(
  ("fields", "words"),
  [
    (dict(fwd_consumers=4, schedule_barrier=False), "`fwd_consumers` must be 2 or 3"),
    (dict(fwd_consumers=3), "needs `schedule_barrier=False`"),
    (dict(fwd_consumers=3, schedule_barrier=False, overlap_qk=True), "`overlap_qk=False`"),
  ],
)
def test_three_consumers_config_is_checked(fields, words):
  with pytest.raises(ValueError, match=re.escape(words)):
    mosaic.MosaicAttentionConfig(**fields)


def test_three_consumers_refuse_large_key_blocks():
  q = jnp.ones((1, 8, 2, 128), jnp.bfloat16)
  config = mosaic.MosaicAttentionConfig(block_kv=128, fwd_consumers=3, schedule_barrier=False)
  reason = mosaic.MosaicAttention(config=config)._unsupported_reason(spec.canonicalize(q, q, q))
  assert "fwd_consumers=3 with block_kv 128 at head dim 128" in reason


@pytest.mark.parametrize(("h", "block_kv"), [(64, 128), (128, 64)])
def test_three_consumers_take_key_blocks_at_the_register_limit(h, block_kv):
  """block_kv * head_dim = 8192, the documented limit of three consumers, is taken."""
  q = jnp.ones((1, 8, 2, h), jnp.bfloat16)
  config = mosaic.MosaicAttentionConfig(block_kv=block_kv, fwd_consumers=3, schedule_barrier=False)
  assert (
    mosaic.MosaicAttention(config=config)._unsupported_reason(spec.canonicalize(q, q, q)) is None
  )


@pytest.mark.parametrize("name", _EXTRA_CASES)
def test_bias_mask_cases_mask_whole_rows(name):
  """The random masks (or -inf bias rows) of the interpret cases leave some query rows with
  no key."""
  kw = _kwargs(CASES[name].features)
  mask = kw["mask"] if "mask" in kw else jnp.isfinite(kw["bias"])
  t = CASES[name].shape["t"]
  if mask.shape[2] == t:
    assert not mask.any(axis=-1).all() and mask.any()


@pytest.mark.parametrize(
  ("bias_shape", "mask_shape", "kw"),
  [
    ((1, 4, 512, 512), (2, 1, 512, 512), {}),
    ((2, 4, 1, 512), (1, 1, 512, 1), dict(is_causal=True, logits_soft_cap=3.0)),
    ((1, 1, 512, 1), (2, 4, 1, 512), dict(local_window_size=(100, 20))),
    ((1, 1, 1, 1), None, {}),
    (None, (1, 1, 1, 1), {}),
  ],
)
@pytest.mark.parametrize("h", [64, 128, 256])
def test_lowers_with_bias_and_mask_for_cuda(bias_shape, mask_shape, kw, h):
  impl = mosaic.MosaicAttention()
  b, t, s, n, kh = 2, 512, 448, 4, 2
  sds = jax.ShapeDtypeStruct

  def f(q, k, v, bias, mask, do):
    record = spec.canonicalize(q, k, v, bias=bias, mask=mask, **kw)
    assert impl._unsupported_reason(record) is None
    assert impl._bwd_unsupported_reason(record) is None
    config = impl._get_heuristics_config(record)
    out, residuals = impl._fwd(record, config)
    return out, impl._bwd(record, config, out, residuals, do)

  shapes = [(b, t, n, h), (b, s, kh, h), (b, s, kh, h)]
  args = [sds(x, jnp.bfloat16) for x in shapes]
  fix = lambda x: None if x is None else (*x[:3], s if x[3] > 1 else 1)
  args.append(None if bias_shape is None else sds(fix(bias_shape), jnp.float32))
  args.append(None if mask_shape is None else sds(fix(mask_shape), jnp.bool_))
  args.append(sds(shapes[0], jnp.bfloat16))
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  for kernel in ("attention_dq", "attention_dk" if h > 128 else "attention_dk_dv"):
    assert kernel in text


@pytest.mark.parametrize(
  ("dtype", "h", "words"),
  [(jnp.float32, 64, "float32"), (jnp.bfloat16, 96, "head dim 96")],
)
def test_unsupported_reason_names_the_feature(dtype, h, words):
  q = jnp.ones((1, 8, 2, h), dtype)
  record = spec.canonicalize(q, q, q)
  reason = mosaic.MosaicAttention(interpret=True)._unsupported_reason(record)
  assert reason is not None and words in reason


def test_unsupported_reason_names_a_value_head_dim_and_an_oversized_config():
  q = jnp.ones((1, 8, 2, 64), jnp.bfloat16)
  v = jnp.ones((1, 8, 2, 128), jnp.bfloat16)
  reason = mosaic.MosaicAttention(interpret=True)._unsupported_reason(spec.canonicalize(q, q, v))
  assert reason is not None and "value head dim 128" in reason
  # Three slots of 64 keys and values at head dim 256 take 257 KiB of shared memory, two 193.
  q = jnp.ones((1, 8, 2, 256), jnp.bfloat16)
  record = spec.canonicalize(q, q, q)
  big = mosaic.MosaicAttentionConfig(block_kv=64, num_stages=3)
  reason = mosaic.MosaicAttention(config=big)._unsupported_reason(record)
  assert reason is not None and "shared memory" in reason
  fits = mosaic.MosaicAttentionConfig(block_kv=64)
  assert mosaic.MosaicAttention(config=fits)._unsupported_reason(record) is None


def test_backward_shared_memory_bytes():
  """The backward kernels' shared memory, counted by hand from what each allocates (compiled):
  dq holds each consumer's query and dO rows and its float32 log-sum-exp and delta rows, and
  streams a key and a value block per slot; dk/dv holds each consumer's key (and, for dk,
  value) block, and streams a query and a dO block and float32 log-sum-exp (and, for dk,
  delta) rows per slot. The dv pass holds no value block and streams no delta."""
  p = mosaic_bwd.BwdParams(
    block_q=64,
    block_kv=128,
    num_stages=3,
    scale=1.0,
    soft_cap=None,
    masking=mosaic_common.Masking(),
  )
  h, bf16, f32 = 128, 2, 4
  q = do = 2 * 64 * h * bf16
  rows = 2 * 64 * f32  # lse or delta, per consumer row
  k = v = 3 * 128 * h * bf16
  assert mosaic_bwd.dq_smem_bytes(p, h) == q + do + 2 * rows + k + v
  assert mosaic_bwd.dq_smem_bytes(p, h, itemsize=4) == 2 * (q + do + k + v) + 2 * rows
  held = 2 * 128 * h * bf16  # one [block_kv, H] block per consumer
  slot = 64 * h * bf16  # one [block_q, H] block per slot
  vec = 64 * f32  # one [block_q] float32 row per slot
  assert mosaic_bwd.dkv_smem_bytes(p, h) == 2 * held + 3 * (2 * slot + 2 * vec)
  assert mosaic_bwd.dkv_smem_bytes(p, h, ("dk",)) == 2 * held + 3 * (2 * slot + 2 * vec)
  assert mosaic_bwd.dkv_smem_bytes(p, h, ("dv",)) == held + 3 * (2 * slot + vec)
  # Forming dq too: each consumer's bfloat16 dS^T tile [block_kv, block_q] and float32 dq
  # share [block_q, H].
  shares = 2 * (128 * 64 * bf16 + 64 * h * f32)
  assert mosaic_bwd.dkv_smem_bytes(p, h, ("dk", "dv", "dq")) == 2 * held + shares + 3 * (
    2 * slot + 2 * vec
  )


@pytest.mark.parametrize(
  ("h", "passes", "registers"),
  [
    (64, [(("dk", "dv", "dq"), 2)], (160, 192)),
    (128, [(("dk", "dv", "dq"), 2)], (192, 192)),
  ],
)
def test_atomic_dq_backward_kernels_and_their_resources(h, passes, registers):
  """deterministic_bwd=False on the heuristics' blocks: the dk/dv passes, the last forming dq,
  with the slots that fit beside the dS and dq tiles; the dq kernel's registers and shared
  memory still count (a causal mask runs it)."""
  q = jnp.ones((1, 8, 2, h), jnp.bfloat16)
  config = mosaic.MosaicAttention()._get_heuristics_config(spec.canonicalize(q, q, q))
  config = dataclasses.replace(config, deterministic_bwd=False)
  _, got = mosaic._bwd_kernel_params(config, h)
  assert [(o, p.num_stages) for o, p in got] == passes
  p_dq, _ = mosaic._bwd_kernel_params(dataclasses.replace(config, deterministic_bwd=True), h)
  kernels = [mosaic_bwd.dkv_smem_bytes(p, h, o) for o, p in got]
  assert mosaic.bwd_smem_bytes(config, h) >= max(*kernels, mosaic_bwd.dq_smem_bytes(p_dq, h))
  assert mosaic.bwd_smem_bytes(config, h) <= mosaic._SMEM_BYTES
  assert mosaic.bwd_registers(config, h) == registers


def test_forward_shared_memory_bytes():
  """The forward's shared memory, counted by hand: 128 query rows, keys and values per slot,
  staged bias and mask tiles per slot and consumer row, and the float32 log-sum-exp rows."""
  config = mosaic.MosaicAttentionConfig(block_kv=128, num_stages=3)
  q, kv = 128 * 64 * 2, 2 * 3 * 128 * 64 * 2
  assert mosaic.smem_bytes(config, 64) == q + kv + 128 * 4
  assert mosaic.smem_bytes(config, 64, 4, staged=(2, 1)) == 2 * q + 2 * kv + 3 * 128 * 128 * 3 + 512
  assert mosaic.smem_bytes(config, 64) <= mosaic._SMEM_BYTES
  # At head dim 256 two slots of 64 keys fit (193 KiB), three do not (257 KiB).
  two, three = (mosaic.MosaicAttentionConfig(block_kv=64, num_stages=n) for n in (2, 3))
  assert mosaic.smem_bytes(two, 256) == 65536 + 131072 + 512 <= mosaic._SMEM_BYTES
  assert mosaic.smem_bytes(three, 256) > mosaic._SMEM_BYTES
  # Three consumers hold 192 query rows (and 192 log-sum-exp rows).
  three_consumers = mosaic.MosaicAttentionConfig(
    block_kv=128, num_stages=3, fwd_consumers=3, schedule_barrier=False
  )
  assert mosaic.smem_bytes(three_consumers, 64) == 192 * 64 * 2 + kv + 192 * 4


@pytest.mark.parametrize("s", [64, 200, 512, 4096])
@pytest.mark.parametrize("h", [64, 128, 256])
def test_heuristic_configs_fit(h, s):
  """The heuristic's config fits shared memory and registers forward and backward."""
  q = jax.ShapeDtypeStruct((1, 256, 2, h), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, s, 1, h), jnp.bfloat16)
  for kw in ({}, dict(is_causal=True)):
    record = jax.eval_shape(lambda q, kv, kw=kw: spec.canonicalize(q, kv, kv, **kw), q, kv)
    impl = mosaic.MosaicAttention()
    config = impl._get_heuristics_config(record)
    assert mosaic.smem_bytes(config, h) <= mosaic._SMEM_BYTES, config
    assert mosaic.bwd_config_reason(config, h) is None
    assert mosaic.MosaicAttention(config=config)._unsupported_reason(record) is None


@pytest.mark.parametrize("h", [64, 128])
def test_heuristic_shrinks_key_blocks_for_staged_planes(h):
  """Full bias and mask planes take slots beside the keys: the heuristic halves its key block
  until they fit, so the forward stages them (`_stages_extras`)."""
  b, t, s = 1, 1024, 1024
  sds = jax.ShapeDtypeStruct
  q = sds((b, t, 2, h), jnp.bfloat16)
  plain = jax.eval_shape(spec.canonicalize, q, q, q)
  bias, mask = sds((1, 2, t, s), jnp.float32), sds((1, 2, t, s), jnp.bool_)
  full = jax.eval_shape(
    lambda *a: spec.canonicalize(*a[:3], bias=a[3], mask=a[4]), q, q, q, bias, mask
  )
  impl = mosaic.MosaicAttention()
  config = impl._get_heuristics_config(full)
  assert impl._get_heuristics_config(plain).block_kv > config.block_kv == 64
  assert mosaic._stages_extras(config, full)
  assert mosaic.smem_bytes(config, h, staged=mosaic._staged_itemsizes(full)) <= mosaic._SMEM_BYTES


@pytest.mark.parametrize(
  ("h", "overrides", "stages"),
  # (dq, dk/dv passes): H256 splits dk and dv and takes the slots that fit (more with
  # the streamed 32-row blocks).
  [
    (64, None, (2, {("dk", "dv"): 2})),
    (128, None, (2, {("dk", "dv"): 2})),
    (256, None, (2, {("dv",): 3, ("dk",): 2})),
    # Overrides of H256's heuristic backward blocks (dq 64/32, 3 slots; dk/dv 32/64, 3 slots).
    (
      256,
      dict(dq_block_kv=64, dq_num_stages=2, bwd_block_q=64, bwd_num_stages=2),
      (1, {("dv",): 2, ("dk",): 1}),
    ),
    (256, dict(dq_num_stages=2, bwd_num_stages=2), (2, {("dv",): 2, ("dk",): 2})),
    (256, dict(dq_num_stages=4, bwd_num_stages=5), (2, {("dv",): 4, ("dk",): 2})),
    (256, dict(dq_num_stages=2, bwd_block_q=64, bwd_num_stages=2), (2, {("dv",): 2, ("dk",): 1})),
  ],
)
def test_backward_passes_and_stages(h, overrides, stages):
  impl = mosaic.MosaicAttention()
  q = jnp.ones((1, 8, 2, h), jnp.bfloat16)
  record = spec.canonicalize(q, q, q)
  assert impl._bwd_unsupported_reason(record) is None
  config = impl._get_heuristics_config(record)
  if overrides is not None:
    config = dataclasses.replace(config, **overrides)
    assert mosaic.bwd_config_reason(config, h) is None
  p_dq, passes = mosaic._bwd_kernel_params(config, h)
  assert (p_dq.num_stages, {o: p.num_stages for o, p in passes}) == stages
  assert mosaic.bwd_smem_bytes(config, h) <= mosaic._SMEM_BYTES


def test_backward_lowers_for_cuda_at_head_dim_256_with_every_feature():
  impl = mosaic.MosaicAttention()
  lengths = dict(query_seq_lengths=jnp.array([3, 50]), key_value_seq_lengths=jnp.array([70, 0]))
  blocks_32 = dict(block_kv=64, dq_block_kv=32, bwd_block_q=32)
  for fields in (
    dict(block_kv=64),
    dict(block_kv=64, bwd_num_stages=1),
    blocks_32,
    dict(blocks_32, dq_num_stages=1, bwd_num_stages=1),
    dict(blocks_32, bwd_num_stages=3),
  ):
    config = mosaic.MosaicAttentionConfig(**fields)
    _lower(
      impl,
      config,
      (2, 200, 300, 4, 2, 256),
      jnp.float16,
      grads=True,
      is_causal=True,
      local_window_size=(50, 10),
      logits_soft_cap=3.0,
      **lengths,
    )


def test_platform_reason():
  if device.has_sm(9) and not device.has_sm(10):
    assert mosaic.MosaicAttention().supported_on()
  else:
    assert not mosaic.MosaicAttention().supported_on()
  assert mosaic.MosaicAttention(interpret=True)._platform_reason("cpu", None) is None


def test_config_validation():
  with pytest.raises(ValueError, match="block_kv"):
    mosaic.MosaicAttentionConfig(block_kv=96)
  with pytest.raises(ValueError, match="block_kv"):
    mosaic.MosaicAttentionConfig(block_kv=512)
  with pytest.raises(ValueError, match="block_kv"):
    mosaic.MosaicAttentionConfig(block_kv=32)
  with pytest.raises(ValueError, match="num_stages"):
    mosaic.MosaicAttentionConfig(num_stages=1)
  with pytest.raises(ValueError, match="bwd_block_q"):
    mosaic.MosaicAttentionConfig(bwd_block_q=16)
  with pytest.raises(ValueError, match="dq_block_q"):
    mosaic.MosaicAttentionConfig(dq_block_q=32)  # Held rows: whole wgmma M tiles.
  with pytest.raises(ValueError, match="bwd_block_kv"):
    mosaic.MosaicAttentionConfig(bwd_block_kv=32)
  with pytest.raises(ValueError, match="bwd_num_stages"):
    mosaic.MosaicAttentionConfig(bwd_num_stages=0)
  with pytest.raises(ValueError, match="dq_block_kv"):
    mosaic.MosaicAttentionConfig(dq_block_kv=256)
  with pytest.raises(ValueError, match="dq_num_stages"):
    mosaic.MosaicAttentionConfig(dq_num_stages=0)


@pytest.mark.parametrize(
  ("h", "fields", "words"),
  [
    (128, dict(bwd_block_kv=128), "registers"),  # dk and dv [128, 128] alone take 256.
    (128, dict(dq_block_q=128), "registers"),
    (64, dict(dq_block_q=128, dq_block_kv=128), "registers"),
    (64, dict(dq_block_q=128), None),
    (256, dict(dq_num_stages=3, bwd_num_stages=3), None),  # Fitted to the slots that fit.
    (256, dict(dq_block_kv=32, bwd_block_q=32), None),  # (160, 160) registers.
    (256, dict(dq_block_kv=32), None),
    (256, dict(dq_block_q=128, dq_block_kv=32), "registers"),  # dq [128, 256] alone: 256.
    (256, dict(bwd_block_q=32, bwd_block_kv=128), "registers"),
    (128, dict(bwd_block_q=32, bwd_block_kv=128), "registers"),  # dk and dv [128, 128]: 256.
    (64, dict(bwd_block_q=32, bwd_block_kv=128), None),
    (64, dict(deterministic_bwd=False, bwd_block_q=32), "bwd_block_q 32 at head dim 64"),
    (128, dict(deterministic_bwd=False, bwd_block_q=32), "bwd_block_q 32 at head dim 128"),
    (256, dict(deterministic_bwd=False, bwd_block_q=32), None),  # The deterministic kernels.
    (128, dict(deterministic_bwd=False, dq_block_q=128), "registers"),  # Causal runs dq.
    (64, dict(deterministic_bwd=False, bwd_block_q=128), None),
  ],
)
def test_backward_config_reason(h, fields, words):
  q = jnp.ones((1, 8, 2, h), jnp.bfloat16)
  record = spec.canonicalize(q, q, q)
  reason = mosaic.MosaicAttention(
    config=mosaic.MosaicAttentionConfig(**fields)
  )._bwd_unsupported_reason(record)
  assert reason is None if words is None else words in reason


def test_backward_padding():
  """T and S pad to whole CTA tiles of one kernel and whole streamed blocks of the other."""
  C = mosaic.MosaicAttentionConfig
  assert mosaic.bwd_padding(C()) == (128, 128)
  assert mosaic.bwd_padding(C(dq_block_q=128, bwd_block_q=128)) == (256, 128)
  assert mosaic.bwd_padding(C(dq_block_kv=128)) == (128, 128)
  assert mosaic.bwd_padding(C(bwd_block_q=128)) == (128, 128)
  assert mosaic.bwd_padding(C(dq_block_kv=32, bwd_block_q=32)) == (128, 128)


_GPU = pytest.mark.skipif(
  not (device.has_sm(9) and not device.has_sm(10)), reason="needs a Hopper (sm_90) GPU"
)


@_GPU
@pytest.mark.parametrize(
  ("shape", "dtype", "kw"),
  [
    (_shape(case), getattr(jnp, case.dtype), case.features)
    for case in opdb.get("dot_product_attention").kernel_cases["mosaic:gpu"].values()
  ],
)
def test_gpu_matches_xla_and_is_deterministic(shape, dtype, kw):
  impl = mosaic.MosaicAttention()
  kw = _kwargs(kw)
  res = _compare(impl, shape, dtype, grads=True, seed=3, **kw)
  assert res["finite"] and res["out"] < 1e-2 and max(res["grads"]) < 1e-2, res
  q, k, v, do = _inputs(4, *shape, dtype)

  def loss(q, k, v):
    return jnp.sum(impl(q, k, v, **kw).astype(jnp.float32) * do)

  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  first, second = f(q, k, v), f(q, k, v)
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
    assert np.array_equal(np.asarray(a), np.asarray(b))


@_GPU
@pytest.mark.parametrize(
  ("shape", "kw", "config", "grads"),
  [
    (_shape(case), case.features, case.config, case.grads)
    for case in opdb.get("dot_product_attention").kernel_cases["mosaic:gpu_configs"].values()
  ],
)
def test_gpu_configs_match_xla(shape, kw, config, grads):
  impl = mosaic.MosaicAttention(config=mosaic.MosaicAttentionConfig(**config))
  res = _compare(impl, shape, jnp.bfloat16, grads=grads, seed=5, **_kwargs(kw))
  assert res["finite"] and res["out"] < 1e-2, res
  if grads:
    assert len(res["grads"]) == 3 and max(res["grads"]) < 1e-2, res


if __name__ == "__main__":
  _case_main(sys.argv[1])


@pytest.mark.parametrize("bias_grad", [False, True])
def test_xla_bias_gradient_only_when_the_bias_is_differentiated(bias_grad):
  """The kernels take dq/dk/dv with a bias; XLA's [B,N,T,S] bias gradient is traced only if needed."""
  impl = mosaic.MosaicAttention()
  sds = jax.ShapeDtypeStruct
  q = sds((2, 256, 4, 128), jnp.bfloat16)
  bias = sds((1, 4, 256, 256), jnp.float32)

  def loss(q, k, v, bias):
    record = spec.canonicalize(q, k, v, bias=bias)
    out = op._with_custom_vjp(impl, record, impl._get_heuristics_config(record))
    return jnp.sum(out.astype(jnp.float32))

  argnums = (0, 1, 2, 3) if bias_grad else (0, 1, 2)
  lowered = jax.jit(jax.grad(loss, argnums=argnums)).trace(q, q, q, bias)
  text = lowered.lower(lowering_platforms=("cuda",)).as_text()
  assert "attention_dq" in text and "attention_dk_dv" in text
  assert ("stablehlo.exponential" in text) == bias_grad


def _abstract_record(h, s, t=256, bias=None, mask=None, **kw):
  """A canonical record of abstract bfloat16 query [1, T, 2, H] and keys/values [1, S, 2, H]."""
  sds = jax.ShapeDtypeStruct
  q, kv = sds((1, t, 2, h), jnp.bfloat16), sds((1, s, 2, h), jnp.bfloat16)
  return jax.eval_shape(
    lambda q, kv, b, m: spec.canonicalize(q, kv, kv, bias=b, mask=m, **kw), q, kv, bias, mask
  )


@pytest.mark.parametrize(
  ("h", "s", "block_kv", "overlap", "consumers"),
  [
    # H64: 64 keys take one 64-key block, up to 511 keys 128; from 512 keys three consumers
    # on 128-key blocks.
    (64, 64, 64, False, 2),
    (64, 65, 128, False, 2),
    (64, 511, 128, False, 2),
    (64, 512, 128, False, 3),
    (64, 4096, 128, False, 3),
    # H128: 128-key blocks with the Q.K^T / softmax overlap (and no schedule barrier),
    # except 64 keys or fewer.
    (128, 64, 64, False, 2),
    (128, 65, 128, True, 2),
    (128, 4096, 128, True, 2),
    # H256: serial 64-key blocks.
    (256, 64, 64, False, 2),
    (256, 4096, 64, False, 2),
  ],
)
def test_heuristic_forward_blocks_and_overlap(h, s, block_kv, overlap, consumers):
  """The forward heuristic's documented choices (`_get_heuristics_config`)."""
  config = mosaic.MosaicAttention()._get_heuristics_config(_abstract_record(h, s))
  assert (config.block_kv, config.num_stages, config.fwd_consumers) == (block_kv, 2, consumers)
  turns = not overlap and consumers == 2
  assert config.overlap_qk == overlap and config.schedule_barrier == turns, config


def test_heuristic_keeps_two_consumers_for_staged_planes():
  """At H64 a bias plane that streams through shared memory keeps two consumers (three
  load planes from global memory)."""
  sds = jax.ShapeDtypeStruct
  bias = sds((1, 2, 1024, 1024), jnp.float32)
  record = _abstract_record(64, 1024, t=1024, bias=bias)
  config = mosaic.MosaicAttention()._get_heuristics_config(record)
  assert config.fwd_consumers == 2 and mosaic._stages_extras(config, record), config


@pytest.mark.parametrize(
  "kw",
  [
    dict(is_causal=True),
    dict(local_window_size=(100, 100)),
    dict(mask=jax.ShapeDtypeStruct((1, 1, 1, 512), jnp.bool_)),
    dict(bias=jax.ShapeDtypeStruct((1, 2, 1, 512), jnp.float32)),
  ],
  ids=["causal", "window", "mask", "bias"],
)
def test_heuristic_overlaps_only_unmasked_h128(kw):
  """Causal masks, windows, masks and biases keep H128 serial, with the schedule barrier."""
  config = mosaic.MosaicAttention()._get_heuristics_config(_abstract_record(128, 512, **kw))
  assert config.block_kv == 128 and not config.overlap_qk and config.schedule_barrier, config


@pytest.mark.parametrize("h", [64, 128])
def test_heuristic_keeps_key_blocks_for_broadcast_planes(h):
  """Bias and mask planes broadcast over queries or keys are not staged in shared memory, so
  the forward heuristic keeps the key block it takes without them."""
  sds = jax.ShapeDtypeStruct
  s, impl = 1024, mosaic.MosaicAttention()
  plain = impl._get_heuristics_config(_abstract_record(h, s, t=1024)).block_kv
  assert plain == 128
  for bias, mask in (
    (sds((1, 2, 1, s), jnp.float32), sds((1, 2, 1024, 1), jnp.bool_)),
    (sds((1, 2, 1024, 1), jnp.float32), sds((1, 1, 1, s), jnp.bool_)),
  ):
    record = _abstract_record(h, s, t=1024, bias=bias, mask=mask)
    assert mosaic._staged_itemsizes(record) == ()
    assert impl._get_heuristics_config(record).block_kv == plain


@pytest.mark.parametrize(
  ("h", "dq", "dkv"),
  # (block_q, block_kv, slots) of the dq and the dk/dv kernel: H64 and H128 stream 128 keys
  # per dq step, H64 128-query blocks in dk/dv; H256 32-row streamed blocks, three slots.
  [
    (64, (64, 128, 2), (128, 64, 2)),
    (128, (64, 128, 2), (64, 64, 2)),
    (256, (64, 32, 3), (32, 64, 3)),
  ],
)
def test_heuristic_backward_blocks(h, dq, dkv):
  config = mosaic.MosaicAttention()._get_heuristics_config(_abstract_record(h, 512))
  assert (config.dq_block_q, config.dq_block_kv, config.dq_num_stages) == dq, config
  assert (config.bwd_block_q, config.bwd_block_kv, config.bwd_num_stages) == dkv, config


@pytest.mark.parametrize("h", [64, 128, 256])
def test_autotuning_forward_variants(h):
  """Forward variants: every key block whose [64, block_kv] score tile and [64, H] output
  accumulator fit the registers (256 keys at H64 only), two to four slots where they fit
  shared memory, with and without the schedule barrier."""
  impl = mosaic.MosaicAttention()
  configs = impl._get_autotuning_configs(_abstract_record(h, 512))
  forwards = {(c.block_kv, c.num_stages, c.schedule_barrier) for c in configs}
  want = {
    (block_kv, stages, sched)
    for block_kv in (64, 128, 256)
    for stages in (2, 3, 4)
    for sched in (True, False)
    if block_kv * h <= 128 * 128
    # Hand count of `smem_bytes`: 128 query rows, `stages` key and value blocks, lse rows.
    and 128 * h * 2 + 2 * stages * block_kv * h * 2 + 512 <= 227 * 1024 - 4096
  }
  assert want <= forwards and {f[0] for f in forwards} == {f[0] for f in want}
  assert (256 in {f[0] for f in forwards}) == (h == 64)


@pytest.mark.parametrize("h", [64, 256])
def test_backward_variants_keep_the_base_first(h):
  """`bwd_variants` lists `base` first, keeps it among the configs its kernels equal after
  fitting the slots, and at H256 also tries single slots (where two would fit)."""
  base = mosaic.MosaicAttention()._get_heuristics_config(_abstract_record(h, 512))
  variants = mosaic.bwd_variants(base, h)
  assert variants[0] == base and len(variants) > 1
  kernels = [mosaic._bwd_kernel_params(c, h) for c in variants]
  assert len({(p, tuple(passes)) for p, passes in kernels}) == len(variants)
  one_slot = [c for c in variants if c.dq_num_stages == 1 or c.bwd_num_stages == 1]
  assert bool(one_slot) == (h == 256)
  for config in variants:
    assert mosaic.bwd_config_reason(config, h) is None
    fields = set(mosaic.MosaicAttentionConfig.BACKWARD_FIELDS)
    assert all(
      getattr(config, f) == getattr(base, f) for f in dataclasses.asdict(base).keys() - fields
    )


def _forward_call(monkeypatch, config, t, s, h, **kw):
  """The params and operands the wrapper's `_fwd` hands the forward kernel (not run)."""
  calls = []

  def fake_forward(params, q, k, v, lengths, bias=None, mask=None, *, interpret=None):
    del interpret
    calls.append((params, q, k, v, lengths, bias, mask))
    b, tp, n, _ = q.shape
    return jnp.zeros(q.shape, q.dtype), jnp.zeros((b, n, tp), jnp.float32)

  monkeypatch.setattr(mosaic.mosaic_fwd, "forward", fake_forward)
  q, k, v, _ = _inputs(0, 1, t, s, 2, 1, h, jnp.bfloat16)
  record = spec.canonicalize(q, k, v, **kw)
  out, _ = mosaic.MosaicAttention(config=config)._fwd(record, config)
  assert out.shape == q.shape and len(calls) == 1
  return calls[0]


@pytest.mark.parametrize(
  ("s", "stages", "want"),
  # Slots past the key blocks are capped (at two, the pipeline's least): 72 keys are one
  # 128-key block, 300 keys three.
  [(72, 4, 2), (300, 4, 3), (300, 2, 2), (600, 3, 3)],
)
def test_forward_slots_capped_by_key_blocks(monkeypatch, s, stages, want):
  config = mosaic.MosaicAttentionConfig(block_kv=128, num_stages=stages)
  params, q, k, *_ = _forward_call(monkeypatch, config, 100, s, 64)
  assert params.num_stages == want
  assert (params.block_q, params.block_kv) == (64, 128)
  # T pads to whole CTA tiles (two consumers of 64 rows), S to whole key blocks.
  assert q.shape[1] == 128 and k.shape[1] == -(-s // 128) * 128


@pytest.mark.parametrize(
  ("h", "block_kv", "bias_dtype", "staged"),
  # Hand counts (bytes): 128 query rows 128*H*2, two slots of keys and values
  # 2*2*block_kv*H*2, two slots of the bias and int8 mask tiles 2*128*block_kv*(itemsize + 1),
  # lse 512; at most 227 KiB - 4 KiB = 228352.
  [
    (64, 64, jnp.bfloat16, True),  # 16384 + 32768 + 49152 + 512
    (64, 128, jnp.float32, False),  # 16384 + 65536 + 163840 + 512
    (64, 128, jnp.bfloat16, True),  # 16384 + 65536 + 98304 + 512
    (128, 128, jnp.bfloat16, False),  # 32768 + 131072 + 98304 + 512
    (128, 64, jnp.float32, True),  # 32768 + 65536 + 81920 + 512
  ],
)
def test_forward_stages_the_planes_only_where_they_fit(
  monkeypatch, h, block_kv, bias_dtype, staged
):
  t, s = 100, 200
  config = mosaic.MosaicAttentionConfig(block_kv=block_kv)
  bias = jax.random.normal(jax.random.key(1), (1, 2, t, s), jnp.float32).astype(bias_dtype)
  mask = _mask(2, (1, 1, t, s))
  params, *_, b, m = _forward_call(monkeypatch, config, t, s, h, bias=bias, mask=mask)
  assert params.stage_extras == staged
  assert b.dtype == bias_dtype and m.dtype == jnp.int8
  s_pad = -(-s // block_kv) * block_kv
  assert b.shape == (1, 2, 128, s_pad) and m.shape == (1, 1, 128, s_pad)
  np.testing.assert_array_equal(np.asarray(b[:, :, :t, :s]), np.asarray(bias))
  np.testing.assert_array_equal(np.asarray(m[:, :, :t, :s]), np.asarray(mask, np.int8))


def test_forward_broadcast_planes_reach_the_kernel_padded(monkeypatch):
  """A bias broadcast over queries and keys becomes one row over all the padded keys; a mask
  broadcast over the keys keeps its one column and pads its rows; a bias broadcast over the
  queries pads its keys only."""
  t, s = 100, 200
  config = mosaic.MosaicAttentionConfig(block_kv=128)
  scalar = jnp.full((1, 1, 1, 1), 0.5, jnp.float32)
  rows = _mask(3, (1, 2, t, 1), dead_rows=0.0)
  *_, b, m = _forward_call(monkeypatch, config, t, s, 64, bias=scalar, mask=rows)
  assert b.shape == (1, 1, 1, 256) and np.all(np.asarray(b) == 0.5)
  assert m.shape == (1, 2, 128, 1) and m.dtype == jnp.int8
  np.testing.assert_array_equal(np.asarray(m[:, :, :t]), np.asarray(rows, np.int8))
  keys = jax.random.normal(jax.random.key(4), (1, 2, 1, s), jnp.float32)
  *_, b, m = _forward_call(monkeypatch, config, t, s, 64, bias=keys)
  assert m is None and b.shape == (1, 2, 1, 256)
  np.testing.assert_array_equal(np.asarray(b[..., :s]), np.asarray(keys))


@pytest.mark.parametrize(("overlap", "sched"), [(True, False), (False, False), (True, True)])
def test_forward_takes_the_configs_schedule(monkeypatch, overlap, sched):
  """The config's overlap and schedule barrier, the scale, soft cap and masking reach the
  forward kernel as given (the interpreter computes the same either way)."""
  config = mosaic.MosaicAttentionConfig(block_kv=64, overlap_qk=overlap, schedule_barrier=sched)
  kw = dict(scale=0.3, logits_soft_cap=4.0, is_causal=True, local_window_size=(20, 0))
  params, *_ = _forward_call(monkeypatch, config, 100, 128, 64, **kw)
  assert (params.overlap_qk, params.schedule_barrier) == (overlap, sched)
  assert (params.scale, params.soft_cap) == (0.3, 4.0)
  assert params.masking == mosaic_common.Masking(causal=True, window=(20, 0))


def _assert_register_budget(consumers: int, consumer_registers: int, producer_registers: int):
  """`setmaxnreg` takes multiples of 8 in [24, 256] per thread, and a CTA's warpgroups (128
  threads each) share the 64K registers of an SM: 512 per thread of one warpgroup in all."""
  regs = (consumer_registers,) * consumers + (producer_registers,)
  assert all(r % 8 == 0 and 24 <= r <= 256 for r in regs), regs
  assert sum(regs) * 128 <= 64 * 1024, regs


_THREE = dict(fwd_consumers=3, schedule_barrier=False)


@pytest.mark.parametrize(
  ("fields", "consumers"),
  [(dict(), 2), (dict(overlap_qk=True, schedule_barrier=False), 2), (_THREE, 3)],
)
def test_forward_warpgroups_share_the_register_file(monkeypatch, fields, consumers):
  """The consumers' and the producer's registers fit the register file: two consumers take
  232 each, three only 160 (a kernel asking for more cannot run on the GPU)."""
  config = mosaic.MosaicAttentionConfig(block_kv=64, **fields)
  params, *_ = _forward_call(monkeypatch, config, 100, 128, 64)
  assert params.consumers == consumers
  _assert_register_budget(consumers, params.consumer_registers, params.producer_registers)


@pytest.mark.parametrize("h", [64, 128, 256])
def test_backward_warpgroups_share_the_register_file(h):
  """Both backward kernels' two consumers and producer fit the register file."""
  config = mosaic.MosaicAttention()._get_heuristics_config(_abstract_record(h, 512))
  for c in (config, dataclasses.replace(config, deterministic_bwd=False)):
    p_dq, passes = mosaic._bwd_kernel_params(c, h)
    for p in (p_dq, *(p for _, p in passes)):
      _assert_register_budget(mosaic_bwd.NUM_CONSUMERS, p.consumer_registers, p.producer_registers)


@pytest.mark.parametrize(("fields", "t_pad", "staged"), [({}, 256, True), (_THREE, 192, False)])
def test_forward_pads_queries_to_whole_tiles(monkeypatch, fields, t_pad, staged):
  """150 query rows: two consumers pad them to whole 128-row tiles (staged bias tiles need
  them), three to whole 64-row blocks (their last tile may be partial, and stages nothing)."""
  config = mosaic.MosaicAttentionConfig(block_kv=64, **fields)
  bias = jax.random.normal(jax.random.key(5), (1, 2, 150, 128), jnp.float32)
  params, q, *_, b, _ = _forward_call(monkeypatch, config, 150, 128, 64, bias=bias)
  assert q.shape[1] == t_pad and b.shape[2] == t_pad
  assert params.stage_extras == staged
