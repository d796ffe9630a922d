"""Triton flash attention (`implementation="triton"`).

On a CPU: every kernel compiles for sm_80 and sm_90 with its heuristic config
(and fits the shared memory there); the wrapper's support reasons, configs,
grids and constants; and the kernels' numbers in Triton's interpreter, forward
and backward, against the XLA implementation. On an NVIDIA GPU: outputs and
gradients through the public API against XLA on float32-upcast inputs at
HIGHEST precision, and a deterministic backward pass.
"""

import dataclasses
import functools
import inspect
import os
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl

import tokamax
from suites import opdb
from suites.kernels.gpu_limits import SMEM_LIMIT
from tokamax._src import device, triton_call
from tokamax._src.ops.attention import spec
from tokamax._src.ops.attention import triton as attention_triton
from tokamax._src.ops.attention.triton_flash import _key_range, _query_range
from tokamax_harness import compare

# The summary counts these under the op and implementation they check.
pytestmark = pytest.mark.op("dot_product_attention", "triton")

HIGHEST = jax.lax.Precision.HIGHEST
ON_GPU = triton_call.unavailable_reason() is None and device.has_sm(8)
gpu_only = pytest.mark.skipif(
  not ON_GPU, reason=f"needs the GPU: {triton_call.unavailable_reason()}"
)
HOPPER = (9, 0)


def _inputs(
  seed=0,
  dtype=jnp.bfloat16,
  b=2,
  t=37,
  s=45,
  n=4,
  k=2,
  h=32,
  hv=None,
  bias=None,
  mask=None,
  q_lengths=False,
  kv_lengths=False,
):
  """Random public arguments: (query, key, value, bias, mask), lengths kwargs."""
  rng = np.random.default_rng(seed)
  hv = h if hv is None else hv

  def normal(shape):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

  arrays = (
    normal((b, t, n, h)),
    normal((b, s, k, h)),
    normal((b, s, k, hv)),
    None if bias is None else normal(bias),
    None if mask is None else jnp.asarray(rng.random(mask) < 0.7),
  )
  lengths = {}
  if q_lengths:
    lengths["query_seq_lengths"] = jnp.asarray(rng.integers(0, t + 1, b), jnp.int32)
  if kv_lengths:
    lengths["key_value_seq_lengths"] = jnp.asarray(rng.integers(0, s + 1, b), jnp.int32)
  return arrays, lengths


def _split(kw: dict) -> tuple[dict, dict]:
  """Splits keywords into those of `_inputs` and the op's options."""
  names = inspect.signature(_inputs).parameters
  return {k: v for k, v in kw.items() if k in names}, {
    k: v for k, v in kw.items() if k not in names
  }


def _seed(name: str) -> int:
  return sum(map(ord, name))


def _case_kw(case) -> dict:
  """A case's shape, dtype and features as keywords of `_inputs` and the op."""
  return {**case.shape, "dtype": getattr(jnp, case.dtype), **case.features}


def _upcast(x):
  if x is None or not jnp.issubdtype(x.dtype, jnp.floating):
    return x
  return x.astype(jnp.float32)


def _reference_vjp(arrays, kwargs, dout):
  """XLA on float32-upcast inputs at HIGHEST: the output and the float-input cotangents."""
  q, k, v, bias, mask = map(_upcast, arrays)
  diff = [q, k, v] + ([bias] if bias is not None else [])

  def f(*xs):
    b = xs[3] if bias is not None else None
    return tokamax.dot_product_attention(
      *xs[:3], b, mask, precision=HIGHEST, implementation="xla", **kwargs
    )

  out, vjp = jax.vjp(f, *diff)
  return out, vjp(dout.astype(jnp.float32))


# -- Wrapper logic (CPU) --------------------------------------------------------


def _args(**kw) -> spec.AttentionArgs:
  data, options = _split(kw)
  arrays, lengths = _inputs(**data)
  return spec.canonicalize(*arrays, **lengths, **options)


@pytest.mark.skipif(ON_GPU, reason="checks the reason given where no GPU is present")
def test_platform_reason_without_gpu():
  op = attention_triton.TritonAttention()
  assert op.unsupported_reason(_args()) == triton_call.unavailable_reason()
  (q, k, v, _, _), _ = _inputs()
  with pytest.raises(NotImplementedError, match="NVIDIA GPU"):
    tokamax.dot_product_attention(q, k, v, implementation="triton")
  # Called directly, the op raises under its spec's name too.
  with pytest.raises(NotImplementedError, match=r"^dot_product_attention\[triton\]: .*NVIDIA GPU"):
    op(q, k, v)
  # `None` falls back to XLA.
  np.testing.assert_array_equal(
    tokamax.dot_product_attention(q, k, v, implementation=None),
    tokamax.dot_product_attention(q, k, v, implementation="xla"),
  )


@pytest.mark.parametrize(
  "kw, words",
  [
    (dict(h=512), "head dims 512"),
    (dict(h=257), "head dims 257"),
    (dict(h=64, hv=320), "head dims 64 and 320"),
    (dict(dtype=jnp.float8_e4m3fn), "float8_e4m3fn"),
    (dict(t=0), "empty"),
  ],
)
def test_unsupported_reasons(kw, words):
  reason = attention_triton.TritonAttention()._unsupported_reason(_args(**kw))
  assert reason is not None and words in reason


def test_unsupported_long_sequence():
  shapes = [jax.ShapeDtypeStruct(x, jnp.bfloat16) for x in ((1, 1 << 20, 16, 128), (1, 16, 1, 128))]
  args = jax.eval_shape(spec.canonicalize, shapes[0], shapes[1], shapes[1])
  reason = attention_triton.unsupported_reason(args)
  assert reason is not None and "32 bits" in reason


def test_unsupported_long_keys():
  """The key/value side alone past 2**31 elements (S * K * H = 2**20 * 16 * 128 = 2**31),
  with a short query."""
  q = jax.ShapeDtypeStruct((1, 16, 16, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 1 << 20, 16, 128), jnp.bfloat16)
  args = jax.eval_shape(spec.canonicalize, q, kv, kv)
  reason = attention_triton.unsupported_reason(args)
  assert reason is not None and "32 bits" in reason
  # One key fewer fits.
  kv = jax.ShapeDtypeStruct((1, (1 << 20) - 1, 16, 128), jnp.bfloat16)
  assert attention_triton.unsupported_reason(jax.eval_shape(spec.canonicalize, q, kv, kv)) is None


def test_unsupported_long_values():
  """A value head dim wider than the query's sets the key/value side's size:
  S * K * HV = 2**19 * 16 * 256 = 2**31 elements, though S * K * H is only 2**29."""
  q = jax.ShapeDtypeStruct((1, 16, 16, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 1 << 19, 16, 64), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, 1 << 19, 16, 256), jnp.bfloat16)
  reason = attention_triton.unsupported_reason(jax.eval_shape(spec.canonicalize, q, k, v))
  assert reason is not None and "32 bits" in reason
  # One key fewer fits.
  k = jax.ShapeDtypeStruct((1, (1 << 19) - 1, 16, 64), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, (1 << 19) - 1, 16, 256), jnp.bfloat16)
  assert attention_triton.unsupported_reason(jax.eval_shape(spec.canonicalize, q, k, v)) is None


@pytest.mark.parametrize(
  "kw", [{}, dict(dtype=jnp.float32, h=256), dict(is_causal=True, local_window_size=(3, 0))]
)
def test_supported(kw):
  assert attention_triton.TritonAttention()._unsupported_reason(_args(**kw)) is None


def test_config_validation():
  with pytest.raises(ValueError, match="block_q"):
    attention_triton.TritonAttentionConfig(block_q=48)
  with pytest.raises(ValueError, match="block_k"):
    attention_triton.TritonAttentionConfig(block_k=8)
  with pytest.raises(ValueError, match="bwd_block_inner"):
    attention_triton.TritonAttentionConfig(bwd_block_inner=96)
  with pytest.raises(ValueError, match="num_warps"):
    attention_triton.TritonAttentionConfig(num_warps=0)


@pytest.mark.parametrize("field", ["num_warps", "bwd_num_warps"])
def test_config_warps_power_of_two(field):
  """Warps per program must be a power of two (Triton's NVIDIA backend asserts it at
  compile time, on the GPU): 6 is refused with the field's name; 1 (2**0), 2, 4 and 16
  are taken."""
  with pytest.raises(ValueError, match=f"`{field}` must be a power of two, got 6"):
    attention_triton.TritonAttentionConfig(**{field: 6})
  for warps in (1, 2, 4, 16):
    assert getattr(attention_triton.TritonAttentionConfig(**{field: warps}), field) == warps


def test_heuristic_config():
  big = _args(t=4096, s=4096, h=128, b=1, n=1, k=1)
  assert attention_triton.heuristic_config(big, HOPPER) == attention_triton.TritonAttentionConfig(
    128, 128, 8, 3, 128, 32, 8, 3
  )
  # A value head dim wider than the query's picks the blocks of the wider one.
  wide_values = _args(t=4096, s=4096, h=64, hv=128, b=1, n=1, k=1)
  assert attention_triton.heuristic_config(
    wide_values, HOPPER
  ) == attention_triton.heuristic_config(big, HOPPER)
  ampere = attention_triton.heuristic_config(big, (8, 0))
  assert (ampere.num_stages, ampere.block_k) == (2, 64)
  # float32 halves the key block (its tiles take twice the bytes).
  f32 = attention_triton.heuristic_config(_args(t=4096, s=4096, h=64, dtype=jnp.float32), HOPPER)
  assert (f32.block_q, f32.block_k, f32.num_stages) == (128, 32, 3)
  short = attention_triton.heuristic_config(_args(t=20, s=9), HOPPER)
  assert (short.block_q, short.block_k, short.bwd_block_outer) == (32, 16, 32)
  # Bias and mask tiles take shared memory too.
  biased = attention_triton.heuristic_config(
    _args(t=4096, s=4096, h=128, b=1, n=1, k=1, bias=(1, 1, 4096, 4096), mask=(1, 1, 4096, 4096)),
    HOPPER,
  )
  assert biased.num_stages == 2
  # Nine queries and a hundred keys: the query block shrinks to 16 rows, but the backward's
  # outer block also holds keys (dK/dV), so it shrinks only to the longer side (128).
  few_queries = attention_triton.heuristic_config(_args(t=9, s=100), HOPPER)
  assert (few_queries.block_q, few_queries.block_k) == (16, 64)
  assert (few_queries.bwd_block_outer, few_queries.bwd_block_inner) == (128, 64)


def test_autotuning_configs_clamped_to_short_sequences():
  """No candidate holds blocks past the sequences padded to powers of two: 20 queries (32)
  and 9 keys (16); the backward blocks stream either side (the longer: 32)."""
  candidates = attention_triton.autotuning_configs(_args(t=20, s=9), HOPPER)
  assert len(candidates) > 1
  for c in candidates:
    assert c.block_q <= 32 and c.block_k <= 16, c
    assert c.bwd_block_outer <= 32 and c.bwd_block_inner <= 32, c


@pytest.mark.parametrize("cc", [(10, 0)])
def test_newer_gpus_take_the_hopper_limit(cc):
  """Compute capability 10.0 (B200: 227 KiB of shared memory a block, as the H100) takes the
  sm_90 configs rather than failing to find a limit."""
  args = _args(t=2048, s=2048, h=128, b=1, n=1, k=1, bias=(1, 1, 2048, 2048))
  assert attention_triton.heuristic_config(args, cc) == attention_triton.heuristic_config(
    args, HOPPER
  )
  assert attention_triton.autotuning_configs(args, cc) == attention_triton.autotuning_configs(
    args, HOPPER
  )


def test_op_configs_follow_the_gpu_at_hand(monkeypatch):
  """The op's heuristic and autotuning configs are those of the device's compute capability
  (an sm_86 GPU: 99 KiB of shared memory, Ampere's stages), not sm_90's."""
  args = _args(t=2048, s=2048, h=128, b=1, n=1, k=1, bias=(1, 1, 2048, 2048))
  ampere = (8, 6)
  assert attention_triton.heuristic_config(args, ampere) != attention_triton.heuristic_config(
    args, HOPPER
  )
  monkeypatch.setattr(device, "compute_capability", lambda device=None: ampere)
  op = attention_triton.TritonAttention()
  assert op._get_heuristics_config(args) == attention_triton.heuristic_config(args, ampere)
  assert op._get_autotuning_configs(args) == attention_triton.autotuning_configs(args, ampere)


def test_shared_memory_counted_by_hand():
  """Bias (bfloat16: 2 bytes) and mask (int8: 1) tiles count per logit; head dims pad to
  powers of two; each backward stage also holds 8 bytes of float32 lse and delta per row."""
  args = _args(
    t=256, s=256, h=100, hv=64, b=1, n=1, k=1, bias=(1, 1, 256, 256), mask=(1, 1, 1, 256)
  )
  fp = attention_triton.Footprint.of(args)
  assert fp == attention_triton.Footprint(h=128, hv=64, itemsize=2, logit_bytes=3)
  config = attention_triton.TritonAttentionConfig(128, 64, 8, 3, 128, 32, 8, 2)
  fwd_stage = 2 * 64 * (128 + 64) + 3 * 128 * 64
  assert attention_triton.fwd_shared_memory(config, fp) == 2 * 128 * 128 + 3 * fwd_stage
  bwd_stage = (2 * (128 + 64) + 8) * 32 + 3 * 128 * 32
  assert attention_triton.bwd_shared_memory(config, fp) == 2 * 128 * (128 + 64) + 2 * bwd_stage
  plain = attention_triton.Footprint.of(_args(h=16, dtype=jnp.float32))
  assert plain == attention_triton.Footprint(h=16, hv=16, itemsize=4, logit_bytes=0)
  # A float32 bias takes 4 bytes a logit (and the mask 1).
  f32_bias = attention_triton.Footprint.of(
    _args(h=16, dtype=jnp.float32, bias=(1, 4, 37, 45), mask=(2, 1, 37, 45))
  )
  assert f32_bias == attention_triton.Footprint(h=16, hv=16, itemsize=4, logit_bytes=5)


def test_shared_memory_limit_by_compute_capability():
  """Each listed GPU's own limit; an unknown one the smallest (99 KiB); without an NVIDIA
  GPU at hand, the sm_90 that kernels are lowered for."""
  for sm, limit in SMEM_LIMIT.items():
    assert device.shared_memory_per_block(divmod(sm, 10)) == limit, sm
  assert device.shared_memory_per_block((13, 0)) == SMEM_LIMIT[89]
  if device.compute_capability() is None:
    assert device.shared_memory_per_block() == SMEM_LIMIT[90]


@pytest.mark.parametrize("sm", [80, 86, 89, 90, 120])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("h", [64, 128, 256])
@pytest.mark.parametrize("bias", [None, (1, 1, 2048, 2048)])
def test_configs_fit_shared_memory(sm, dtype, h, bias):
  """By the kernels' own count: sm_86, sm_89 and sm_120 (99 KiB) get smaller configs."""
  args = _args(t=2048, s=2048, h=h, dtype=dtype, b=1, n=1, k=1, bias=bias)
  cc = divmod(sm, 10)
  limit = SMEM_LIMIT[sm]
  footprint = attention_triton.Footprint.of(args)
  heuristic = attention_triton.heuristic_config(args, cc)
  candidates = attention_triton.autotuning_configs(args, cc)
  assert heuristic in candidates and len(candidates) > 1
  for config in candidates:
    assert attention_triton.fwd_shared_memory(config, footprint) <= limit
    assert attention_triton.bwd_shared_memory(config, footprint) <= limit


def _capture(args, config):
  """Runs forward and backward with launches recorded instead of run."""
  with triton_call.capture() as launches:
    out, lse = attention_triton.forward(args, config)
    grads = attention_triton.backward(args, config, out, lse, jnp.ones_like(out))
  return launches, grads


def test_grids_and_constants():
  args = _args(b=3, t=100, s=70, n=6, k=2, h=40, hv=24, bias=(1, 6, 1, 70), mask=(3, 1, 100, 70))
  config = attention_triton.TritonAttentionConfig(64, 32, 4, 2, 32, 16, 8, 3)
  launches, grads = _capture(args, config)
  fwd, dkdv, dq = launches
  for launch in (dkdv, dq):  # The backward's own warps and stages.
    assert (launch.meta["num_warps"], launch.meta["num_stages"]) == (8, 3)
  assert fwd.grid == (2 * 6 * 3,)  # cdiv(T, block_q) * N * B
  assert dkdv.grid == (3 * 2 * 3,)  # cdiv(S, bwd_block_outer) * K * B
  assert dq.grid == (4 * 6 * 3,)  # cdiv(T, bwd_block_outer) * N * B
  meta = fwd.meta
  assert (meta["BLOCK_M"], meta["BLOCK_N"], meta["num_warps"], meta["num_stages"]) == (64, 32, 4, 2)
  assert (meta["BLOCK_H"], meta["BLOCK_HV"]) == (64, 32)
  assert [meta[f"BIAS_S{d}"] for d in "BNTS"] == [0, 70, 0, 1]
  assert [meta[f"MASK_S{d}"] for d in "BNTS"] == [7000, 0, 70, 1]
  assert fwd.args[4].dtype == jnp.int8
  assert (dkdv.meta["BLOCK_M"], dkdv.meta["BLOCK_N"], dq.meta["BLOCK_M"]) == (16, 32, 32)
  # The logits' gradient in the bias's dtype (bfloat16 here), summed over the broadcast dims.
  assert args.bias.dtype == jnp.bfloat16
  assert dkdv.out_shape[2].shape == (3, 6, 100, 70) and dkdv.out_shape[2].dtype == jnp.bfloat16
  assert grads["bias"].shape == (1, 6, 1, 70) and grads["bias"].dtype == jnp.bfloat16


@pytest.mark.parametrize(("h", "hv"), [(17, 33), (65, 129), (16, 32)])
def test_head_blocks_are_the_next_powers_of_two_of_the_head_dims(h, hv):
  """A head dim just past a power of two (17, 33, 65, 129) pads to the next one (a block
  narrower than the head dim would drop its last columns); 16 and 32 stay as they are."""
  args = _args(b=1, t=20, s=24, n=2, k=1, h=h, hv=hv)
  config = attention_triton.TritonAttentionConfig(16, 16, 4, 2, 16, 16, 4, 2)
  with triton_call.capture() as launches:
    attention_triton.forward(args, config)

  def next_pow2(x):
    p = 16
    while p < x:
      p *= 2
    return p

  meta = launches[0].meta
  assert (meta["BLOCK_H"], meta["BLOCK_HV"]) == (next_pow2(h), next_pow2(hv)), meta
  fp = attention_triton.Footprint.of(args)
  assert (fp.h, fp.hv) == (next_pow2(h), next_pow2(hv))


def test_scalar_constants_and_cotangent_dtype():
  """The kernels' scalar constants, by hand, with only query lengths (the key-length flag
  stays off), 6 query heads over 2 key/value heads, and a soft cap; a float32 output
  cotangent reaches the bfloat16 backward kernels as bfloat16."""
  args = _args(b=2, t=20, s=24, n=6, k=2, h=16, q_lengths=True, logits_soft_cap=30.0)
  config = attention_triton.TritonAttentionConfig(16, 16, 4, 2, 16, 16, 4, 2)
  with triton_call.capture() as launches:
    out, lse = attention_triton.forward(args, config)
    attention_triton.backward(args, config, out, lse, jnp.ones(out.shape, jnp.float32))
  for launch in launches:
    meta = launch.meta
    assert (meta["T"], meta["S"], meta["N"], meta["KH"], meta["H"], meta["HV"]) == (
      20,
      24,
      6,
      2,
      16,
      16,
    )
    assert (meta["HAS_Q_LEN"], meta["HAS_KV_LEN"]) == (True, False)
    assert meta["SOFT_CAP"] == 30.0 and meta["SCALE"] == pytest.approx(0.25)
  _, dkdv, dq = launches
  for launch in (dkdv, dq):
    assert launch.args[7].shape == out.shape and launch.args[7].dtype == jnp.bfloat16


@pytest.mark.parametrize(
  ("precision", "expected"),
  [(HIGHEST, "ieee"), (jax.lax.Precision.HIGH, "tf32x3"), (jax.lax.Precision.DEFAULT, "tf32")],
  ids=["highest", "high", "default"],
)
def test_precision_sets_the_input_precision_of_every_launch(precision, expected):
  """float32 inputs: the caller's precision picks tl.dot's input precision in the forward
  and both backward kernels (HIGHEST must not run as TF32)."""
  args = _args(dtype=jnp.float32, h=16, precision=precision)
  config = attention_triton.TritonAttentionConfig(16, 16, 4, 2, 16, 16, 4, 2)
  launches, _ = _capture(args, config)
  assert [launch.meta["DOT_PRECISION"] for launch in launches] == [expected] * 3


def test_backward_row_sums_of_16_bit_outputs_in_float32():
  """The backward kernels' delta (sum over the value head dim of out * dout, [B,N,T]) is
  summed in float32 from bfloat16 output and cotangent, not rounded to bfloat16 (its error
  would pass into every dS = P (dP - delta))."""
  args = _args(b=2, t=20, s=24, n=4, k=2, h=16, hv=64)
  config = attention_triton.TritonAttentionConfig(16, 16, 4, 2, 16, 16, 4, 2)
  rng = np.random.default_rng(5)
  out, dout = (jnp.asarray(rng.standard_normal((2, 20, 4, 64)), jnp.bfloat16) for _ in range(2))
  lse = jnp.zeros((2, 4, 20), jnp.float32)
  with triton_call.capture() as launches:
    attention_triton.backward(args, config, out, lse, dout)
  expected = np.einsum("btnh,btnh->bnt", np.asarray(out, np.float64), np.asarray(dout, np.float64))
  for launch in launches:
    delta = launch.args[9]
    assert delta.dtype == jnp.float32 and delta.shape == (2, 4, 20)
    np.testing.assert_allclose(np.asarray(delta), expected, rtol=1e-5, atol=1e-5)


# -- Compiling for sm_80 and sm_90 (CPU) ------------------------------------------

# Spilling is checked on the cases that carry the speed targets.
NO_SPILL = ("bf16-h128", "bf16-h64-causal", "bf16-h256")
COMPILE_CASES = opdb.get("dot_product_attention").kernel_cases["triton:compile"]
_CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")


def _resource_usage(compiled) -> dict[str, int]:
  """Registers and stack-frame bytes of a compiled kernel, from its cubin."""
  with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(compiled.asm["cubin"])
    f.flush()
    text = subprocess.run(
      [_CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
    ).stdout
  line = next(line for line in text.splitlines() if "REG:" in line)
  return {k: int(v) for k, v in (item.split(":") for item in line.split()[:2])}


@pytest.mark.parametrize("sm", [80, 90])
@pytest.mark.parametrize("case", COMPILE_CASES)
def test_compiles(case, sm):
  kw = _case_kw(COMPILE_CASES[case])
  args = _args(**kw)
  config = attention_triton.heuristic_config(args, divmod(sm, 10))
  launches, _ = _capture(args, config)
  assert [launch.kernel.__name__ for launch in launches] == [
    "fwd_kernel",
    "dkdv_kernel",
    "dq_kernel",
  ]
  for launch in launches:
    compiled = triton_call.compile_launch(launch, sm)
    assert compiled.metadata.shared <= SMEM_LIMIT[sm]
    if sm == 90 and np.dtype(kw.get("dtype", jnp.bfloat16)).itemsize == 2:
      assert "wgmma" in compiled.asm["ptx"]  # Hopper's warpgroup matmuls.
    if sm == 90 and case in NO_SPILL:
      assert _resource_usage(compiled)["STACK"] == 0, launch.kernel.__name__


@pytest.mark.parametrize("sm", [89, 120])
@pytest.mark.parametrize(
  "h, dtype, bias",
  [(64, jnp.float32, None), (128, jnp.bfloat16, (1, 1, 1024, 1024)), (256, jnp.bfloat16, None)],
)
def test_heuristic_configs_compile_within_99_kib(sm, h, dtype, bias):
  """L40S/RTX 4090 (sm_89) and RTX 50 (sm_120) give a block 99 KiB: the Hopper- or
  Ampere-sized configs asked the compiler for up to 131 KiB, which fails at launch."""
  args = _args(t=1024, s=1024, h=h, dtype=dtype, b=1, n=1, k=1, bias=bias)
  config = attention_triton.heuristic_config(args, divmod(sm, 10))
  for launch in _capture(args, config)[0]:
    shared = triton_call.compile_launch(launch, sm).metadata.shared
    assert shared <= SMEM_LIMIT[sm], (launch.kernel.__name__, shared)


def test_bias_and_mask_head_offsets_in_64_bits():
  """A bias and mask of 16 heads of 16384 x 16384 (2**32 elements, accepted: the kernels
  index a batch element's planes in 64 bits): the head's plane offset n * T * S must not
  be an int32 product (it passes 2**31 at head 8)."""
  t = s = 16384
  q = jax.ShapeDtypeStruct((1, t, 16, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, s, 16, 64), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct((1, 16, t, s), jnp.bfloat16)
  mask = jax.ShapeDtypeStruct((1, 16, t, s), jnp.bool_)
  args = jax.eval_shape(spec.canonicalize, q, kv, kv, bias, mask)
  assert attention_triton.unsupported_reason(args) is None
  config = attention_triton.heuristic_config(args, HOPPER)

  def run(args):
    out, lse = attention_triton.forward(args, config)
    return attention_triton.backward(args, config, out, lse, out)

  with triton_call.capture() as launches:
    jax.eval_shape(run, args)
  assert [launch.meta["BIAS_SN"] for launch in launches] == [t * s] * 3
  for launch in launches:
    ttir = triton_call.compile_launch(launch, 90).asm["ttir"]
    assert f"{t * s} : i32" not in ttir, launch.kernel.__name__


def test_compiles_autotuning_space(request):
  if not request.config.getoption("--run-long"):
    pytest.skip("compiles every autotuning config (minutes); runs with --run-long")
  args = _args(b=1, t=1024, s=1024, n=4, k=4, h=128)
  for sm in (80, 90):
    for config in attention_triton.autotuning_configs(args, divmod(sm, 10)):
      for launch in _capture(args, config)[0]:
        compiled = triton_call.compile_launch(launch, sm)
        assert compiled.metadata.shared <= SMEM_LIMIT[sm]


# -- Numbers in Triton's interpreter (CPU) -----------------------------------------

INTERPRET_CASES = opdb.get("dot_product_attention").kernel_cases["triton:interpret"]


@pytest.mark.parametrize("case", INTERPRET_CASES)
@pytest.mark.host_only
def test_interpreted(case):
  config = attention_triton.TritonAttentionConfig(**INTERPRET_CASES[case].config)
  _check_interpreted(dict(seed=_seed(case)) | _case_kw(INTERPRET_CASES[case]), config)


@pytest.mark.host_only
def test_interpreted_heuristic_blocks():
  """The heuristic's (large) blocks, with partly visible and skipped blocks of each kind."""
  kw = dict(b=2, t=300, s=333, n=2, k=1, h=64, dtype=jnp.float32, is_causal=True)
  kw |= dict(q_lengths=True, kv_lengths=True, local_window_size=(150, 0))
  _check_interpreted(kw, None)


@pytest.mark.host_only
def test_interpreted_bias_gradient_where_rows_see_no_key():
  """dbias with a causal window and sequence lengths: whole query blocks before and after
  each key block's visible rows are skipped, and their dbias must still be written (zeros),
  as must the rows past the query length. Unwritten outputs read NaN in the interpreter."""
  kw = dict(seed=11, dtype=jnp.float32, b=2, t=37, s=45, n=2, k=1, h=16, bias=(2, 2, 37, 45))
  kw |= dict(is_causal=True, local_window_size=(6, 0), q_lengths=True, kv_lengths=True)
  config = attention_triton.TritonAttentionConfig(16, 16, 4, 2, 16, 16, 4, 2)
  _check_interpreted(kw, config)


@pytest.mark.host_only
@pytest.mark.parametrize(
  "visibility",
  [dict(is_causal=True), dict(local_window_size=(3, 2))],
  ids=["causal", "right_window"],
)
def test_interpreted_bias_gradient_of_keys_past_the_last_query(visibility):
  """20 queries and 70 keys with a bias: the key blocks from key 32 on start past the last
  query row (19), so no query row of theirs is visited, and dbias gets zeros for rows up
  to T only. Zeros up to the first visible row (32 or more) went past the head's plane,
  for the last head past the end of the buffer: on a GPU, a write into other memory (the
  interpreter's guard bytes around each output raise)."""
  kw = dict(seed=15, dtype=jnp.float32, b=1, t=20, s=70, n=2, k=1, h=16, bias=(1, 2, 20, 70))
  config = attention_triton.TritonAttentionConfig(16, 16, 4, 2, 32, 16, 4, 2)
  _check_interpreted(kw | visibility, config)


@pytest.mark.host_only
def test_interpreted_padded_head_dims_in_whole_key_blocks():
  """Head dims 24 and 40 (padded to 32 and 64 columns) with 32 keys, two whole blocks of
  16: every key block runs without row masks, and its loads must still mask the padded
  columns. The last key row's padding lies past the end of the key and value buffers
  (the interpreter reads NaN there; on a GPU, anything)."""
  kw = dict(seed=16, dtype=jnp.float32, b=1, t=24, s=32, n=2, k=1, h=24, hv=40)
  config = attention_triton.TritonAttentionConfig(16, 16, 4, 2, 16, 16, 4, 2)
  _check_interpreted(kw, config)


@pytest.mark.host_only
@pytest.mark.parametrize("window", [(17, 1), (1, 17)], ids=["left17_right1", "left1_right17"])
def test_interpreted_window_edges_on_block_boundaries(window):
  """Windows whose first or last visible key is the first or last key of a 16-key block for
  the first or last row of a 16-row block: an off-by-one in the key (or query) range of the
  kernels' block loops drops that whole block."""
  kw = dict(seed=13, dtype=jnp.float32, b=1, t=48, s=50, n=2, k=1, h=16)
  kw |= dict(local_window_size=window)
  config = attention_triton.TritonAttentionConfig(16, 16, 4, 2, 16, 16, 4, 2)
  _check_interpreted(kw, config)


@pytest.mark.host_only
def test_interpreted_lengths_out_of_range():
  """Sequence lengths past the sequence (all of it is seen) or negative (none is): the kernels
  clip them to [0, T] and [0, S], as the XLA implementation's comparisons do."""
  kw = dict(seed=12, dtype=jnp.float32, b=3, t=37, s=45, n=2, k=1, h=16)
  lengths = {
    "query_seq_lengths": jnp.array([50, 20, -2], jnp.int32),
    "key_value_seq_lengths": jnp.array([60, -4, 30], jnp.int32),
  }
  config = attention_triton.TritonAttentionConfig(16, 16, 4, 2, 16, 16, 4, 2)
  _check_interpreted(kw, config, lengths)


@pytest.mark.host_only
def test_interpreted_logits_far_below_zero():
  """A bias of about -120 puts every logit where exp underflows in float32: the running row
  max must start at -inf, not 0, or exp2(logit - 0) is zero and rows come out empty."""
  kw = dict(seed=14, dtype=jnp.float32, b=1, t=37, s=45, n=2, k=1, h=16, bias=(1, 2, 37, 45))
  config = attention_triton.TritonAttentionConfig(16, 16, 4, 2, 16, 16, 4, 2)
  _check_interpreted(kw, config, bias_shift=-120.0)


@triton.jit
def _block_ranges(
  q_len,
  kv_len,
  out_ptr,
  KEYS: tl.constexpr,
  T: tl.constexpr,
  BLOCK_M: tl.constexpr,
  BLOCK_N: tl.constexpr,
  CAUSAL: tl.constexpr,
  LEFT: tl.constexpr,
  RIGHT: tl.constexpr,
):
  """Stores (lo, full_lo, full_hi, hi) of program i's block: `_key_range` of query block i
  (KEYS) or `_query_range` of key block i."""
  pid = tl.program_id(0)
  if KEYS:
    lo, full_lo, full_hi, hi = _key_range(
      pid * BLOCK_M, q_len, kv_len, BLOCK_M, BLOCK_N, CAUSAL, LEFT, RIGHT
    )
  else:
    lo, full_lo, full_hi, hi = _query_range(
      pid * BLOCK_N, q_len, kv_len, T, BLOCK_M, BLOCK_N, CAUSAL, LEFT, RIGHT
    )
  tl.store(out_ptr + pid * 4 + 0, lo)
  tl.store(out_ptr + pid * 4 + 1, full_lo)
  tl.store(out_ptr + pid * 4 + 2, full_hi)
  tl.store(out_ptr + pid * 4 + 3, hi)


def _pairs_visible(rows, keys, kv_len, causal, left, right):
  """Positional visibility of every (row, key) pair: bool [rows, keys]."""
  r, c = np.asarray(rows)[:, None], np.asarray(keys)[None, :]
  ok = np.broadcast_to(c < kv_len, (r.size, c.size)).copy()
  if causal:
    ok &= c <= r
  if left >= 0:
    ok &= c >= r - left
  if right >= 0:
    ok &= c <= r + right
  return ok


@pytest.mark.host_only
def test_interpreted_block_ranges_run_whole_blocks_unmasked():
  """The kernels' block loops, as the module docstring states them: every block a row can
  see is visited, and of the visited blocks exactly those that every row (query blocks:
  every key) sees in full run without positional masks. For the forward and dQ loops (key
  blocks of a query block) and the dK/dV loop (query blocks of a key block, whose unmasked
  loads also need the whole block inside T), against pairwise visibility in numpy."""
  t, s = 45, 61
  lengths = [(t, s), (30, 50), (0, s), (t, 0)]
  visibility = [(False, -1, -1), (True, -1, -1), (False, 40, -1), (True, 33, -1)]
  visibility += [(False, 17, 1), (False, 20, 35), (False, -1, 17), (True, 30, 5)]
  with triton_call.interpret():
    for bm, bn in [(16, 16), (16, 32), (32, 16)]:
      for causal, left, right in visibility:
        for q_len, kv_len in lengths:
          for keys in (True, False):
            count = -(-t // bm) if keys else -(-s // bn)
            ranges = triton_call.call(
              _block_ranges,
              q_len,
              kv_len,
              out_shape=jax.ShapeDtypeStruct((count, 4), jnp.int32),
              grid=(count,),
              KEYS=keys,
              T=t,
              BLOCK_M=bm,
              BLOCK_N=bn,
              CAUSAL=causal,
              LEFT=left,
              RIGHT=right,
            )
            where = f"blocks {bm}x{bn} causal={causal} window=({left}, {right}) "
            where += f"lengths=({q_len}, {kv_len}) {'key' if keys else 'query'} range"
            for i, (lo, full_lo, full_hi, hi) in enumerate(np.asarray(ranges).tolist()):
              # The loops' tiles: [lo, full_lo) and [full_hi, hi) masked, the rest not.
              step = bn if keys else bm
              assert lo <= full_lo <= full_hi <= hi, (where, i)
              tiles = {x: True for x in range(lo, full_lo, step)}
              tiles |= {x: False for x in range(full_lo, full_hi, step)}
              tiles |= {x: True for x in range(full_hi, hi, step)}
              assert all(x % step == 0 for x in tiles), (where, i, tiles)
              assert len(tiles) == len(range(lo, full_lo, step)) + len(
                range(full_lo, full_hi, step)
              ) + len(range(full_hi, hi, step)), (where, i)
              own = np.arange(i * (bm if keys else bn), (i + 1) * (bm if keys else bn))
              for x in range(0, s if keys else t, step):
                other = np.arange(x, x + step)
                rows, cols = (own, other) if keys else (other, own)
                ok = _pairs_visible(rows, cols, kv_len, causal, left, right)
                whole = bool(ok.all()) and (keys or x + step <= t)
                seen = bool(ok[rows < q_len].any())
                if seen:
                  assert x in tiles, (where, i, x, "a visible block is skipped")
                if x in tiles:
                  assert tiles[x] == (not whole), (where, i, x, "masked" if tiles[x] else "whole")


def _check_interpreted(kw, config, lengths=None, bias_shift=0.0):
  """Interpreted forward and backward against XLA; `lengths` replaces the drawn lengths and
  `bias_shift` is added to the drawn bias."""
  data, options = _split(kw)
  arrays, drawn = _inputs(**data)
  if bias_shift:
    arrays = (*arrays[:3], arrays[3] + bias_shift, arrays[4])
  lengths = drawn if lengths is None else lengths
  args = spec.canonicalize(*arrays, **lengths, **options)
  config = config or attention_triton.heuristic_config(args, HOPPER)
  dout = jnp.asarray(
    np.random.default_rng(1).standard_normal(args.query.shape[:3] + args.value.shape[-1:]),
    args.query.dtype,
  )
  with triton_call.interpret():
    out, lse = attention_triton.forward(args, config)
    grads = attention_triton.backward(args, config, out, lse, dout)
  ref_out, ref_grads = _reference_vjp(arrays, {**lengths, **options}, dout)
  tol = 1e-5 if kw["dtype"] == jnp.float32 else 2e-3
  assert compare.relative_error(out, ref_out) < tol
  names = ["query", "key", "value"] + (["bias"] if arrays[3] is not None else [])
  for name, ref in zip(names, ref_grads, strict=True):
    assert grads[name].shape == ref.shape, name
    assert compare.relative_error(grads[name], ref) < tol, name
  # The log-sum-exp is base 2, and +inf exactly where a row sees no key.
  q, k, _ = (_upcast(x) for x in (args.query, args.key, args.value))
  logits, ok = spec.logits_and_mask(
    dataclasses.replace(args, precision=HIGHEST),
    q,
    k,
    _upcast(args.bias),
    args.mask,
    jnp.arange(q.shape[1]),
    jnp.arange(k.shape[1]),
  )
  if ok is not None:
    logits = jnp.where(ok, logits, -jnp.inf)
  ref_lse = jax.nn.logsumexp(logits, axis=-1).reshape(lse.shape) / np.log(2)
  seen = np.isfinite(np.asarray(ref_lse))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), seen)
  np.testing.assert_allclose(np.asarray(lse)[seen], np.asarray(ref_lse)[seen], rtol=1e-5, atol=1e-5)


# -- Numbers on the GPU -----------------------------------------------------------

GPU_CASES = opdb.get("dot_product_attention").kernel_cases["triton:gpu"]
_TOLERANCE = {jnp.bfloat16: 1e-2, jnp.float16: 3e-3, jnp.float32: 3e-3}


@gpu_only
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_matches_xla(case):
  kw = dict(seed=_seed(case)) | _case_kw(GPU_CASES[case])
  data, options = _split(kw)
  arrays, lengths = _inputs(**data)
  q, k, v, bias, mask = arrays
  diff = [q, k, v] + ([bias] if bias is not None else [])

  def f(*xs):
    b = xs[3] if bias is not None else None
    return tokamax.dot_product_attention(
      *xs[:3], b, mask, implementation="triton", **lengths, **options
    )

  out, vjp = jax.vjp(jax.jit(f), *diff)
  dout = jax.random.normal(jax.random.key(3), out.shape, jnp.float32).astype(out.dtype)
  grads = jax.jit(vjp)(dout)
  ref_out, ref_grads = _reference_vjp(arrays, {**lengths, **options}, dout)
  tol = _TOLERANCE[kw["dtype"]]
  names = ("out", "dq", "dk", "dv", "dbias")[: 1 + len(grads)]
  for name, x, ref in zip(names, (out, *grads), (ref_out, *ref_grads), strict=True):
    assert np.isfinite(np.asarray(x, np.float32)).all(), name
    assert compare.relative_error(x, ref) < tol, (name, compare.relative_error(x, ref))
    max_err = float(jnp.max(jnp.abs(x.astype(jnp.float32) - ref)))
    assert max_err <= 10 * tol * float(jnp.max(jnp.abs(ref))) + 1e-6, (name, max_err)


def _head(arrays, n):
  """(q, k, v, bias, mask) of head n alone (heads on axis 2 of q, k, v and 1 of the planes)."""
  q, k, v, bias, mask = arrays
  planes = [None if x is None else x[:, n : n + 1] for x in (bias, mask)]
  return (q[:, :, n : n + 1], k[:, :, n : n + 1], v[:, :, n : n + 1], *planes)


@gpu_only
@pytest.mark.parametrize("plane", ["bias", "mask"])
def test_gpu_planes_past_int32(plane):
  """Nine heads of 16384 x 16384 bias or mask planes: head 8's plane starts at 2**31
  elements. Heads 0 and 8 of the output (and, with the mask, of dq, dk and dv) against XLA
  run on that head alone. Sized for one suite worker's share of the GPU (about 9 GB): the
  bias, whose float32 gradient alone would take 9.7 GB, is checked forward."""
  t = s = 16384
  keys = jax.random.split(jax.random.key(7), 5)
  q, k, v = (jax.random.normal(key, (1, t, 9, 64), jnp.bfloat16) for key in keys[:3])
  # Made inside jit and passed as arguments: no float32 temporary, no 4.8 GB constant.
  if plane == "bias":
    make = lambda key: {"bias": jax.random.normal(key, (1, 9, t, s), jnp.bfloat16)}
  else:
    make = lambda key: {"mask": jax.random.uniform(key, (1, 9, t, s)) < 0.9}
  planes = jax.jit(make)(keys[3])
  attend = jax.jit(
    lambda q, k, v, planes: tokamax.dot_product_attention(
      q, k, v, **planes, implementation="triton"
    )
  )
  out, vjp = jax.vjp(functools.partial(attend, planes=planes), q, k, v)
  dout = jax.random.normal(keys[4], out.shape, out.dtype)
  results = {"out": out}
  if plane == "mask":
    results |= zip(("dq", "dk", "dv"), vjp(dout), strict=True)
  # Only the two heads' planes stay, so that the references have the memory.
  arrays = (q, k, v, planes.get("bias"), planes.get("mask"))
  heads = {n: _head(arrays, n) for n in (0, 8)}
  del arrays, planes, vjp
  for n, head in heads.items():
    if plane == "mask":
      ref_out, ref_grads = _reference_vjp(head, {}, dout[:, :, n : n + 1])
    else:
      ref_out = tokamax.dot_product_attention(
        *map(_upcast, head), precision=HIGHEST, implementation="xla"
      )
      ref_grads = ()
    refs = dict(zip(("out", "dq", "dk", "dv"), (ref_out, *ref_grads), strict=False))
    for name, x in results.items():
      error = compare.relative_error(x[:, :, n : n + 1], refs[name])
      assert error < _TOLERANCE[jnp.bfloat16], (n, name, error)


@gpu_only
def test_gpu_backward_is_deterministic():
  arrays, _ = _inputs(t=512, s=512, n=8, k=2, h=128)
  q, k, v, _, _ = arrays
  f = jax.jit(
    jax.grad(
      lambda q, k, v: (
        tokamax.dot_product_attention(q, k, v, is_causal=True, implementation="triton")
        .astype(jnp.float32)
        .sum()
      ),
      argnums=(0, 1, 2),
    )
  )
  first, second = f(q, k, v), f(q, k, v)
  for a, b in zip(first, second, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_interpreter_leaves_triton_language_as_it_was():
  """Triton's interpreter patches the language for helpers; left patched, later compiles break."""
  spaces = triton_call._language_namespaces()
  before = [dict(vars(ns)) for ns in spaces]
  test_interpreted("causal-gqa")
  for ns, old in zip(spaces, before, strict=True):
    now = dict(vars(ns))
    changed = sorted(k for k in old if old[k] is not now.get(k))
    assert not changed, f"{getattr(ns, '__name__', ns)}: {changed[:10]}"
