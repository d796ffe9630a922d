"""Triton gated_linear_unit: compile for sm_80/sm_90 (no register spills), wrapper
logic, interpreted numerics on CPU, compiled numerics on an NVIDIA GPU.

Not covered on CPU: timings and the compiled kernel's numerics (the GPU test
below and ci/gpu/triton_mm_norm.py cover them on the H200).
"""

import dataclasses
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from suites import opdb
from suites.kernels import interpreted
from suites.kernels.gpu_limits import SMEM_LIMIT
from tokamax._src import jaxprs, triton_call
from tokamax._src.ops.gated_linear_unit import api, spec
from tokamax._src.ops.gated_linear_unit import triton as glu_triton
from tokamax_harness import compare, references

# The summary counts these under the op and implementation they check.
pytestmark = pytest.mark.op("gated_linear_unit", "triton")

OP = glu_triton.TritonGatedLinearUnit()

# `kernel_cases.GluKernelCase`s (in the op database).
CASES = list(opdb.get("gated_linear_unit").kernel_cases["triton"].values())
GPU_CASES = [*CASES, *opdb.get("gated_linear_unit").kernel_cases["triton:gpu"].values()]


def _inputs(x_shape, n, dtype, fused, seed=0):
  rng = np.random.default_rng(seed)
  k = x_shape[-1]
  x = jnp.asarray(rng.standard_normal(x_shape), dtype)
  w = jnp.asarray(rng.standard_normal((k, 2, n)) / np.sqrt(k), dtype)
  dout = jnp.asarray(rng.standard_normal((*x_shape[:-1], n)), dtype)
  return x, (w if fused else (w[:, 0], w[:, 1])), dout


def _record(x_shape, n, dtype, activation, fused):
  x, weights, _ = _inputs(x_shape, n, dtype, fused)
  return spec.canonicalize(x, weights, activation=activation)


def _case_record(case):
  return _record(case.x_shape, case.n, case.dtype, case.activation, case.fused)


@pytest.mark.parametrize("sm", [80, 89, 90])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("save", [False, True])
def test_heuristic_config_compiles_with_wgmma_and_without_spills(sm, dtype, save):
  args = _record((256, 512), 1024, dtype, jax.nn.swish, True)
  with triton_call.capture() as launches:
    glu_triton.forward(args, OP._get_heuristics_config(args), save)
  compiled = triton_call.compile_launch(launches[0], sm)
  assert compiled.metadata.shared <= SMEM_LIMIT[sm]
  if sm == 90 and dtype == "bfloat16":
    assert "warp_group_dot" in compiled.asm["ttgir"]  # wgmma, not mma.sync.
  from triton.backends.nvidia import compiler as nvidia

  ptx = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"glu_{os.getpid()}.ptx")
  with open(ptx, "w") as f:
    f.write(compiled.asm["ptx"])
  report = subprocess.run(
    [
      nvidia.get_ptxas(sm).path,
      "-v",
      f"--gpu-name=sm_{sm}{'a' if sm == 90 else ''}",
      ptx,
      "-o",
      ptx + ".cubin",
    ],
    capture_output=True,
    text=True,
    check=True,
  ).stderr
  assert "0 bytes spill stores" in report, report


def test_autotuning_configs_compile_for_sm90():
  args = _record((256, 512), 512, "bfloat16", jax.nn.swish, False)
  configs = OP._get_autotuning_configs(args)
  assert OP._get_heuristics_config(args) in configs
  for config in configs:
    with triton_call.capture() as launches:
      glu_triton.forward(args, config, False)
    assert triton_call.compile_launch(launches[0], 90).metadata.shared <= SMEM_LIMIT[90]


@pytest.mark.parametrize("case", CASES)
def test_wrapper_shapes_and_gradient_structure(case):
  x_shape, n = case.x_shape, case.n
  args = _case_record(case)
  config = OP._get_heuristics_config(args)
  with triton_call.capture() as launches:
    out, residuals = OP._fwd(args, config)
    primal = OP._fwd_primal(args, config)
  assert out.shape == primal.shape == (*x_shape[:-1], n) and out.dtype == args.x.dtype
  assert [r.shape for r in residuals] == [(np.prod(x_shape[:-1]), n)] * 2
  assert [s.shape for s in launches[1].out_shape[1:]] == [(1,), (1,)]  # No residuals written.
  grads = OP._bwd(args, config, out, residuals, jnp.ones_like(out))
  assert grads["x"].shape == args.x.shape
  assert jax.tree.structure(grads["weights"]) == jax.tree.structure(args.weights)


@pytest.mark.host_only
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "pair"])
def test_interpreted_cotangents_come_back_in_the_inputs_dtypes(fused):
  """float16 x and weights through jax.vjp of the public call: dx and dW are float16 (the
  backward's XLA matmuls accumulate in float32, and nothing after the op casts a custom
  VJP's cotangents back to its inputs' dtypes)."""
  x, weights, dout = _inputs((2, 12, 16), 8, "float16", fused)
  op = OP.with_config(glu_triton.TritonGluConfig(32, 32, 16, 2, 4, 2))

  def fn(a, b):
    return api.gated_linear_unit(a, b, activation=jax.nn.silu, implementation=op)

  with triton_call.interpret():
    out, vjp = jax.vjp(fn, x, weights)
    dx, dw = vjp(dout)
  assert out.dtype == dx.dtype == jnp.float16 and dx.shape == x.shape
  assert jax.tree.structure(dw) == jax.tree.structure(weights)
  for got, want in zip(jax.tree.leaves(dw), jax.tree.leaves(weights), strict=True):
    assert (got.shape, got.dtype) == (want.shape, want.dtype)


def test_unsupported_reasons():
  args = _case_record(CASES[0])
  assert OP._unsupported_reason(args) is None
  assert "activation" in OP._unsupported_reason(dataclasses.replace(args, activation=jnp.sin))
  mixed = dataclasses.replace(args, x=args.x.astype(jnp.bfloat16))
  assert "mixed dtypes" in OP._unsupported_reason(mixed)
  f64 = dataclasses.replace(
    args, x=np.asarray(args.x, np.float64), weights=np.asarray(args.weights, np.float64)
  )
  reason = OP._unsupported_reason(f64)
  assert reason is not None and "dtype float64" in reason, reason


@pytest.mark.host_only
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "pair"])
def test_mixed_dtypes_are_refused_by_name_and_fall_back_to_xla(fused):
  """float32 x with a float16 weight: XLA promotes, the kernel (one dtype per tl.dot) refuses
  and names the weight; implementation=None and [triton, "xla"] fall back to XLA's promoted
  float32 result (Triton's interpreter makes triton a candidate on this host)."""
  x, weights, _ = _inputs((20, 16), 8, "float32", fused)
  if fused:
    weights, name = weights.astype(jnp.float16), "weights is float16, x is float32"
  else:
    weights, name = (weights[0], weights[1].astype(jnp.float16)), "weights[1] (up) is float16"
  reason = OP._unsupported_reason(spec.canonicalize(x, weights, activation=jax.nn.silu))
  assert reason is not None and name in reason, reason
  ref = references.high_precision(references.gated_linear_unit)(x, weights, activation=jax.nn.silu)
  with triton_call.interpret():
    with pytest.raises(NotImplementedError, match=r"mixed dtypes: weights"):
      api.gated_linear_unit(x, weights, activation=jax.nn.silu, implementation="triton")
    for implementation in (None, [OP, "xla"]):
      out = api.gated_linear_unit(
        x,
        weights,
        activation=jax.nn.silu,
        precision=jax.lax.Precision.HIGHEST,
        implementation=implementation,
      )
      assert out.dtype == jnp.float32 and out.shape == (20, 8)
      assert compare.relative_error(out, ref) < 1e-5


def test_unsupported_reasons_of_32_bit_weights_and_an_empty_width():
  """Both projections' weights (K x 2N elements) index in 32 bits: 2**31 of them are refused,
  one column fewer each is not; N = 0 is an empty input."""

  def record(k, n):
    shapes = [
      jax.ShapeDtypeStruct((8, k), jnp.bfloat16),
      jax.ShapeDtypeStruct((k, 2, n), jnp.bfloat16),
    ]
    return jax.eval_shape(lambda x, w: spec.canonicalize(x, w, activation=jax.nn.swish), *shapes)

  reason = OP._unsupported_reason(record(1 << 16, 1 << 14))
  assert reason is not None and "2**31" in reason, reason
  assert OP._unsupported_reason(record(1 << 16, (1 << 14) - 1)) is None
  reason = OP._unsupported_reason(record(64, 0))
  assert reason is not None and "empty" in reason, reason


@pytest.mark.parametrize("x_shape", [(0, 64), (2, 0, 64), (8, 0)], ids=["m0", "batch_m0", "k0"])
def test_unsupported_reasons_of_no_rows_or_an_empty_k(x_shape):
  """No rows (M = 0, also under batch dims) or K = 0 is an empty input: left to XLA, not
  launched as an empty grid or an empty contraction."""
  k = x_shape[-1]
  shapes = [
    jax.ShapeDtypeStruct(x_shape, jnp.bfloat16),
    jax.ShapeDtypeStruct((k, 2, 16), jnp.bfloat16),
  ]
  record = jax.eval_shape(lambda x, w: spec.canonicalize(x, w, activation=jax.nn.swish), *shapes)
  reason = OP._unsupported_reason(record)
  assert reason is not None and "empty" in reason, reason


@dataclasses.dataclass
class _ScaledSilu:
  """A callable activation that is not hashable (a non-frozen dataclass)."""

  scale: float = 2.0

  def __call__(self, g):
    return jax.nn.silu(g) * self.scale


def test_unhashable_activation_is_refused_by_name():
  """An activation the kernel's table cannot look up (unhashable) is an unsupported activation,
  named in the reason, not a TypeError out of the support check."""
  shapes = [
    jax.ShapeDtypeStruct((8, 64), jnp.bfloat16),
    jax.ShapeDtypeStruct((64, 2, 16), jnp.bfloat16),
  ]
  record = jax.eval_shape(lambda x, w: spec.canonicalize(x, w, activation=_ScaledSilu()), *shapes)
  reason = OP._unsupported_reason(record)
  assert reason is not None and "activation _ScaledSilu" in reason, reason


@pytest.mark.requires("cpu")
def test_cpu_names_triton_unavailable():
  x, weights, _ = _inputs((8, 16), 8, "float32", True)
  with pytest.raises(NotImplementedError, match="Triton"):
    api.gated_linear_unit(x, weights, implementation="triton")


def _reference(activation):
  return lambda x, w: references.gated_linear_unit(x, w, activation=activation)


def _interpreted_errors(case) -> dict:
  """Runs the kernel in Triton's interpreter."""
  dtype, activation = case.dtype, case.activation
  x, weights, dout = _inputs(case.x_shape, case.n, dtype, case.fused)
  args = spec.canonicalize(x, weights, activation=activation, precision=jax.lax.Precision.HIGHEST)
  config = glu_triton.TritonGluConfig(32, 32, 16, 2, 4, 2)
  with triton_call.interpret():
    out, residuals = OP._fwd(args, config)
    primal = OP._fwd_primal(args, config)
  grads = OP._bwd(args, config, out, residuals, dout)
  ref_out, (rx, rw) = references.high_precision_vjp(_reference(activation), (x, weights), dout)
  errs = {
    "out": compare.relative_error(out, ref_out),
    "primal": compare.relative_error(primal, ref_out),
    "x": compare.relative_error(grads["x"], rx),
  }
  for i, (g, r) in enumerate(
    zip(jax.tree.leaves(grads["weights"]), jax.tree.leaves(rw), strict=True)
  ):
    errs[f"w{i}"] = compare.relative_error(g, r)
  return {"case": repr((case.x_shape, case.n, dtype, case.fused)), "dtype": dtype, "errors": errs}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.host_only
def test_interpreted_kernels_match_float64_reference(case):
  interpreted.assert_errors_within_bound(_interpreted_errors(case))


@pytest.mark.parametrize(
  "activation",
  [jax.nn.relu, jax.nn.leaky_relu, jnp.tanh, jax.nn.gelu, jax.nn.silu, jax.nn.sigmoid],
  ids=["relu", "leaky_relu", "tanh", "gelu", "silu", "sigmoid"],
)
@pytest.mark.host_only
def test_interpreted_activations_match_float64_reference(activation):
  """Each activation the kernel names, in its epilogue: a small float32 case with gate values
  of both signs (the kernel cases leave relu, leaky_relu and tanh out, and run sigmoid only
  through the unfused pair)."""
  case = dataclasses.replace(CASES[0], x_shape=(24, 16), n=24, activation=activation)
  result = _interpreted_errors(case)
  assert result["dtype"] == "float32"
  interpreted.assert_errors_within_bound(result)


@pytest.mark.requires("triton")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_matches_reference_with_gradients(case, dtype):
  if (reason := triton_call.unavailable_reason()) is not None:
    pytest.skip(reason)  # E.g. jax-triton is not installed.
  activation = case.activation
  x, weights, dout = _inputs(case.x_shape, case.n, dtype, case.fused, seed=1)

  def fn(x, w):
    return api.gated_linear_unit(
      x, w, activation=activation, precision=jax.lax.Precision.HIGHEST, implementation="triton"
    )

  out, vjp = jax.vjp(jax.jit(fn), x, weights)
  gx, gw = vjp(dout)
  ref_out, (rx, rw) = references.high_precision_vjp(_reference(activation), (x, weights), dout)
  limit = {"float32": 1e-5, "bfloat16": 1e-2}[dtype]
  assert compare.relative_error(out, ref_out) <= limit
  assert compare.relative_error(gx, rx) <= limit
  for g, r in zip(jax.tree.leaves(gw), jax.tree.leaves(rw), strict=True):
    assert compare.relative_error(g, r) <= limit


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "pair"])
@pytest.mark.parametrize(
  ("precision", "expected"),
  [(jax.lax.Precision.HIGHEST, "ieee"), (jax.lax.Precision.DEFAULT, "tf32")],
  ids=["highest", "default"],
)
def test_precision_reaches_the_forward_launch_and_the_backward_matmuls(precision, expected, fused):
  """float32 inputs: the caller's precision picks tl.dot's input precision in the forward
  kernel (with and without residuals), and the backward's XLA matmuls (dx, dw) take it too."""
  x, weights, dout = _inputs((24, 16), 8, "float32", fused)
  args = spec.canonicalize(x, weights, activation=jax.nn.silu, precision=precision)
  config = OP._get_heuristics_config(args)
  with triton_call.capture() as launches:
    OP._fwd(args, config)
    OP._fwd_primal(args, config)
  assert [launch.meta["INPUT_PRECISION"] for launch in launches] == [expected] * 2
  residuals = (jnp.ones((24, 8), jnp.float32),) * 2
  jaxpr = jax.make_jaxpr(lambda r, d: OP._bwd(args, config, None, r, d))(residuals, dout)
  dots = [e for e in jaxprs.equations(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
  assert len(dots) == 2
  want = jax.lax.Precision(precision)
  assert all(e.params["precision"] in (want, (want, want)) for e in dots), dots


@pytest.mark.parametrize(
  ("m", "n", "dtype", "expected"),
  [
    # 128 rows and 128 columns take the 128 x (2 x 128) tile with 8 warps, three stages;
    # 16-bit inputs step 64 of K.
    (128, 128, "bfloat16", (128, 128, 64, 8, 8, 3)),
    # float32 steps 32 of K (the 64 step's three stages exceed sm_80's shared memory).
    (128, 128, "float32", (128, 128, 32, 8, 8, 3)),
    # One row or column short of 128: 64-wide tiles, 4 warps for 64-row tiles.
    (127, 128, "bfloat16", (64, 128, 64, 8, 4, 3)),
    (128, 127, "bfloat16", (128, 64, 64, 8, 8, 3)),
  ],
)
def test_heuristic_tiles_by_hand(m, n, dtype, expected):
  config = OP._get_heuristics_config(_record((m, 32), n, dtype, jax.nn.silu, True))
  fields = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")
  assert tuple(getattr(config, f) for f in fields) == expected


def test_float32_autotuning_candidate_with_the_most_shared_memory_compiles_for_sm90():
  """float32 (4-byte) tiles: the candidate whose stages of x and both weight tiles take the
  most shared memory still fits sm_90's."""
  args = _record((256, 512), 512, "float32", jax.nn.swish, True)
  configs = OP._get_autotuning_configs(args)

  def stage_bytes(c):
    return (c.block_m * c.block_k + 2 * c.block_k * c.block_n) * 4 * c.num_stages

  largest = max(configs, key=lambda c: (stage_bytes(c), c.block_m, c.block_n))
  with triton_call.capture() as launches:
    glu_triton.forward(args, largest, False)
  assert triton_call.compile_launch(launches[0], 90).metadata.shared <= SMEM_LIMIT[90], largest


@pytest.mark.host_only
@pytest.mark.parametrize(("m", "n"), [(100, 40), (40, 100)], ids=["tall", "wide"])
def test_interpreted_grids_of_unequal_row_and_column_tile_counts(m, n):
  """4 row tiles of 32 by 2 column tiles, and 2 by 4 (the kernel cases' grids are square at
  the interpreted tiles): the launch counts each axis's own tiles and the grouped program
  order visits every (row tile, column tile) pair."""
  x, w, _ = _inputs((m, 24), n, "float32", True, seed=5)
  args = spec.canonicalize(x, w, activation=jax.nn.silu, precision=jax.lax.Precision.HIGHEST)
  config = glu_triton.TritonGluConfig(32, 32, 16, 2, 4, 2)
  with triton_call.interpret():
    out = OP._fwd_primal(args, config)
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  gate, up = x64 @ w64[:, 0], x64 @ w64[:, 1]
  np.testing.assert_allclose(out, gate / (1 + np.exp(-gate)) * up, rtol=1e-5, atol=1e-5)


@pytest.mark.host_only
def test_interpreted_config_of_the_defaults_runs():
  """`TritonGluConfig()` fills the fields a caller leaves out: its tiles are powers of two
  (`tl.arange` takes no other length) and its warps a power of two (Triton's NVIDIA backend
  asserts it), and the kernel at those tiles computes silu(x @ Wg) * (x @ Wu)."""
  config = glu_triton.TritonGluConfig()
  for field in ("block_m", "block_n", "block_k", "num_warps"):
    value = getattr(config, field)
    assert value > 0 and value & (value - 1) == 0, (field, value)
  x, w, _ = _inputs((20, 24), 40, "float32", True, seed=6)
  args = spec.canonicalize(x, w, activation=jax.nn.silu, precision=jax.lax.Precision.HIGHEST)
  with triton_call.interpret():
    out = OP._fwd_primal(args, config)
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  gate, up = x64 @ w64[:, 0], x64 @ w64[:, 1]
  np.testing.assert_allclose(out, gate / (1 + np.exp(-gate)) * up, rtol=1e-5, atol=1e-5)
