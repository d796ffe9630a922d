"""Mosaic GPU gated_linear_unit on CPU: the fused kernel in the Pallas GPU
interpreter (with race detection) on small shapes, and CUDA lowering of every
tuning config. Compiled numerics: suites/kernels/test_gpu_compiled.py on the H200;
timings: `python -m bench.run`.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

from suites import opdb
from tokamax._src import jaxprs
from tokamax._src.ops import kernel_ops
from tokamax._src.ops.gated_linear_unit import api, mosaic, mosaic_kernel, spec
from tokamax_harness import compare, references

# The summary counts these under the op and implementation they check.
pytestmark = pytest.mark.op("gated_linear_unit", "mosaic")

SMALL = mosaic.MosaicGluConfig(block_n=64, num_stages=2, epi_n=64, grid_tile_m=2)


# `kernel_cases.GluKernelCase`s (in the op database); N is 128.
CASES = opdb.get("gated_linear_unit").kernel_cases["mosaic"]


@pytest.mark.parametrize(
  ("shape", "tuple_weights", "activation", "backward", "config"),
  [
    (
      case.x_shape,
      not case.fused,
      case.activation,
      case.backward,
      None if case.config is None else mosaic.MosaicGluConfig(**case.config),
    )
    for case in CASES.values()
  ],
)
@pytest.mark.host_only
def test_interpret_matches_reference_with_gradients(
  shape, tuple_weights, activation, backward, config, capfd
):
  impl = mosaic.MosaicGatedLinearUnit(interpret=True, config=config, backward=backward)
  _check_against_reference(shape, tuple_weights, activation, impl, capfd)


@pytest.mark.host_only
def test_interpret_epilogue_stores_every_column_chunk(capfd):
  """block_n=128 stored in two epi_n=64 chunks (the output and both residual halves): each
  chunk goes to its own columns."""
  config = mosaic.MosaicGluConfig(block_n=128, num_stages=2, epi_n=64, grid_tile_m=2)
  impl = mosaic.MosaicGatedLinearUnit(interpret=True, config=config)
  _check_against_reference((64, 128), False, jax.nn.swish, impl, capfd)


@pytest.mark.host_only
def test_interpret_ragged_dot_backward_of_more_rows_than_columns(capfd):
  """M=264 rows, more than K=128 and the fused 2N=256 columns: dx and dW in the ragged_dot
  kernels take all M rows as their one group."""
  impl = mosaic.MosaicGatedLinearUnit(interpret=True, config=SMALL, backward="mosaic")
  _check_against_reference((264, 128), False, jax.nn.swish, impl, capfd)


def _check_against_reference(shape, tuple_weights, activation, impl, capfd):
  rng = np.random.default_rng(len(shape) + shape[-2])
  k, n = shape[-1], 128
  x = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((k, 2, n)) / np.sqrt(k), jnp.bfloat16)
  weights = (w[:, 0], w[:, 1]) if tuple_weights else w

  def fn(a, b):
    return api.gated_linear_unit(a, b, activation=activation, implementation=impl)

  primal = fn(x, weights)  # The kernel without residuals.
  out, vjp = jax.vjp(fn, x, weights)  # The kernel that also writes the residuals.
  ct = jnp.asarray(rng.standard_normal(out.shape), jnp.bfloat16)
  dx, dw = vjp(ct)
  ref, (ref_dx, ref_dw) = references.high_precision_vjp(
    lambda a, b: references.gated_linear_unit(a, b, activation=activation),
    (x, weights),
    ct,
  )
  assert not interpret_pallas_call.get_races().races_found
  assert "RACE DETECTED" not in capfd.readouterr().out
  assert compare.relative_error(primal, ref) < 5e-3
  assert compare.relative_error(out, ref) < 5e-3
  assert compare.relative_error(dx, ref_dx) < 1e-2
  assert jax.tree.structure(dw) == jax.tree.structure(weights)
  for got, want in zip(jax.tree.leaves(dw), jax.tree.leaves(ref_dw), strict=True):
    assert compare.relative_error(got, want) < 1e-2


def _lower(m, k, n, configs, save_residuals=False):
  op = mosaic.MosaicGatedLinearUnit()
  shapes = (
    jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
    jax.ShapeDtypeStruct((k, 2, n), jnp.bfloat16),
  )

  def fn(x, w):
    record = spec.canonicalize(x, w, activation=jax.nn.swish)
    return [op._run(record, c, save_residuals) for c in configs(record)]

  text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_every_autotuning_config_lowers_for_cuda():
  op = mosaic.MosaicGatedLinearUnit()
  seen = []

  def configs(record):
    # grid_tile_m only reorders work items: one value covers the kernel structure.
    found = {dataclasses.replace(c, grid_tile_m=8) for c in op._get_autotuning_configs(record)}
    seen.extend(sorted(found, key=dataclasses.astuple))
    return seen

  _lower(512, 512, 256, configs)
  assert len(seen) >= 4


@pytest.mark.parametrize(
  ("m", "k", "n"), [(8192, 4096, 14336), (2048, 2048, 8192), (128, 4096, 14336)]
)
def test_heuristic_and_residual_configs_lower_for_target_shapes(m, k, n):
  op = mosaic.MosaicGatedLinearUnit()
  _lower(m, k, n, lambda r: [op._get_heuristics_config(r)])
  _lower(
    m, k, n, lambda r: [op._residual_config(r, op._get_heuristics_config(r))], save_residuals=True
  )


def test_benchmarked_residual_alternatives_lower_for_cuda():
  """The residual-writing alternatives that were benchmarked besides the default."""
  wide = mosaic.MosaicGluConfig(block_n=128, num_stages=3, epi_n=128, grid_tile_m=8)
  _lower(8192, 4096, 14336, lambda r: [wide, dataclasses.replace(wide, cluster=2)], True)


@pytest.mark.parametrize(
  ("m", "k", "n"), [(8192, 4096, 14336), (2048, 2048, 8192), (512, 4096, 14336)]
)
def test_residual_config_keeps_the_pipeline_depth(m, k, n):
  op = mosaic.MosaicGatedLinearUnit()
  record = spec.canonicalize(
    jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, 2, n), jnp.bfloat16)
  )
  config = op._get_heuristics_config(record)
  residual = op._residual_config(record, config)
  assert residual.num_stages == config.num_stages
  assert (residual.block_n, residual.grid_tile_m) == (config.block_n, config.grid_tile_m)
  assert mosaic._config_reason(record, residual, True) is None


@pytest.mark.parametrize("backward", mosaic.BACKWARDS)
@pytest.mark.parametrize(("m", "k", "n"), [(2048, 2048, 8192), (128, 4096, 14336)])
def test_forward_and_backward_lower_for_cuda(m, k, n, backward, monkeypatch):
  """The benchmarked program, jax.vjp of the op, with every Mosaic op taken as supported."""
  monkeypatch.setattr(kernel_ops.MosaicGpuOp, "_platform_reason", lambda *_: None)
  op = mosaic.MosaicGatedLinearUnit(backward=backward)

  def fwd_bwd(x, w, ct):
    f = lambda a, b: api.gated_linear_unit(a, b, activation=jax.nn.swish, implementation=op)
    out, vjp = jax.vjp(f, x, w)
    return out, vjp(ct)

  shapes = [((m, k), jnp.bfloat16), ((k, 2, n), jnp.bfloat16), ((m, n), jnp.bfloat16)]
  shapes = [jax.ShapeDtypeStruct(*s) for s in shapes]
  text = jax.jit(fwd_bwd).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
  kernels = len(re.findall(r"custom_call @mosaic_gpu", text))
  # The residual-writing forward kernel, plus dx and dW in the ragged_dot kernels.
  assert kernels == (3 if backward == "mosaic" else 1)
  if backward == "xla":  # Two matmuls over the fused 2N columns.
    assert len(re.findall(r"stablehlo.dot_general", text)) == 2


def test_custom_jvp_activation_lowers_for_cuda(monkeypatch):
  """jax.nn.relu in the plain forward's and the residual-writing forward's epilogues."""
  monkeypatch.setattr(kernel_ops.MosaicGpuOp, "_platform_reason", lambda *_: None)
  op = mosaic.MosaicGatedLinearUnit()
  f = lambda a, b: api.gated_linear_unit(a, b, activation=jax.nn.relu, implementation=op)
  x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((512, 2, 512), jnp.bfloat16)
  for program in (f, lambda a, b: jax.vjp(f, a, b)[0]):
    text = jax.jit(program).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1


def test_backward_choice():
  assert mosaic.MosaicGatedLinearUnit()._backward() == ("xla", "xla")  # Measured faster.
  assert mosaic.MosaicGatedLinearUnit(backward="mosaic")._backward() == ("mosaic", "mosaic")
  assert mosaic.MosaicGatedLinearUnit(backward="xla")._backward() == ("xla", "xla")
  mixed = ("xla", "mosaic")
  assert mosaic.MosaicGatedLinearUnit(backward=mixed)._backward() == mixed
  for bad in ("cublas", ("xla",), ("xla", "triton")):
    with pytest.raises(ValueError, match="backward"):
      mosaic.MosaicGatedLinearUnit(backward=bad)


@pytest.mark.parametrize(
  ("backward", "xla_shape"),
  [(("mosaic", "xla"), (128, 384)), (("xla", "mosaic"), (64, 128))],
  ids=["dx_mosaic", "dw_mosaic"],
)
def test_mixed_backward_runs_each_matmul_where_asked(backward, xla_shape):
  """backward=(dx's, dW's) of fused weights (M=64, K=128, 2N=384): the backward's one XLA
  matmul is dW [K, 2N] where dx runs in the ragged_dot kernels, and dx [M, K] where dW does
  (the values are the same either way; the choice is the caller's, for speed)."""
  x = jnp.ones((64, 128), jnp.bfloat16)
  w = jnp.ones((128, 2, 192), jnp.bfloat16)
  impl = mosaic.MosaicGatedLinearUnit(interpret=True, config=SMALL, backward=backward)

  def f(a, b):
    out = api.gated_linear_unit(a, b, activation=jax.nn.swish, implementation=impl)
    return out.astype(jnp.float32).sum()

  jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w).jaxpr
  dots = [e for e in jaxprs.equations(jaxpr) if e.primitive.name == "dot_general"]
  assert [e.outvars[0].aval.shape for e in dots] == [xla_shape], dots


def test_unsupported_reasons_name_the_feature():
  impl = mosaic.MosaicGatedLinearUnit(interpret=True)
  x = jnp.ones((64, 128), jnp.bfloat16)
  w = jnp.ones((128, 2, 128), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="sort"):
    impl(x, w, activation=lambda g: jnp.sort(g, axis=-1))
  with pytest.raises(NotImplementedError, match="dtype float32"):
    impl(x.astype(jnp.float32), w.astype(jnp.float32))
  with pytest.raises(NotImplementedError, match="N=96"):
    impl(x, jnp.ones((128, 2, 96), jnp.bfloat16))
  out = api.gated_linear_unit(
    x, w, activation=lambda g: jnp.sort(g, axis=-1), implementation=[impl, "xla"]
  )
  assert out.shape == (64, 128)


@pytest.mark.parametrize("activation", [jax.nn.relu, jax.nn.relu6], ids=["relu", "relu6"])
def test_custom_jvp_activations_are_inlined(activation):
  """custom_jvp functions (which Mosaic GPU cannot lower as such) run as their primal's
  equations in the epilogue, forward and derivative."""
  impl = mosaic.MosaicGatedLinearUnit(interpret=True)
  record = spec.canonicalize(
    jnp.ones((64, 128), jnp.bfloat16), jnp.ones((128, 2, 128), jnp.bfloat16), activation=activation
  )
  assert impl._unsupported_reason(record) is None
  assert impl._bwd_unsupported_reason(record) is None
  g = jnp.linspace(-8.0, 8.0, 64 * 64, dtype=jnp.float32).reshape(64, 64)
  jaxpr = jax.make_jaxpr(mosaic_kernel.apply_activation, static_argnums=0)(activation, g)
  assert not {e.primitive.name for e in jaxprs.equations(jaxpr.jaxpr)} & {"custom_jvp_call", "jit"}
  expected = np.clip(np.asarray(g), 0.0, 6.0 if activation is jax.nn.relu6 else np.inf)
  np.testing.assert_array_equal(mosaic_kernel.apply_activation(activation, g), expected)


def test_reasons_name_the_activation():
  impl = mosaic.MosaicGatedLinearUnit(interpret=True)

  def ranked(g):
    return jnp.sort(g, axis=-1)

  record = spec.canonicalize(
    jnp.ones((64, 128), jnp.bfloat16), jnp.ones((128, 2, 128), jnp.bfloat16), activation=ranked
  )
  reason = impl._unsupported_reason(record)
  assert reason is not None and "activation ranked uses sort" in reason, reason


@dataclasses.dataclass
class _UnhashableActivation:
  """A callable activation that is not hashable (a non-frozen dataclass)."""

  scale: float = 2.0
  ranked: bool = False

  def __call__(self, g):
    return (jnp.sort(g, axis=-1) if self.ranked else jax.nn.silu(g)) * self.scale


def test_reasons_of_unhashable_activations():
  """The support check traces an unhashable activation (no TypeError from its cache): a
  lowerable one is supported, one that sorts is refused by what it uses."""
  impl = mosaic.MosaicGatedLinearUnit(interpret=True)

  def reasons(activation):
    record = spec.canonicalize(
      jnp.ones((64, 128), jnp.bfloat16),
      jnp.ones((128, 2, 128), jnp.bfloat16),
      activation=activation,
    )
    return impl._unsupported_reason(record), impl._bwd_unsupported_reason(record)

  assert reasons(_UnhashableActivation()) == (None, None)
  fwd, bwd = reasons(_UnhashableActivation(ranked=True))
  assert "uses sort" in fwd and "uses sort" in bwd, (fwd, bwd)


def test_kernel_config_reason_clusters_whole_column_tile_pairs():
  """A cluster of two CTAs takes two neighbouring column tiles: N must hold an even number."""
  config = mosaic_kernel.MosaicGluKernelConfig(block_n=128, num_stages=2, epi_n=64, cluster=2)
  k = 512
  assert mosaic_kernel.config_reason(config, 256, k, 256, 2) is None  # 2 tiles of 128.
  assert mosaic_kernel.config_reason(config, 256, k, 512, 2) is None  # 4 tiles.
  reason = mosaic_kernel.config_reason(config, 256, k, 384, 2)  # 3 tiles.
  assert reason is not None and "cluster" in reason
  single = dataclasses.replace(config, cluster=1)
  assert mosaic_kernel.config_reason(single, 256, k, 384, 2) is None


def test_unsupported_reasons_of_mixed_dtypes_and_empty_dimensions():
  """Weights in another dtype than x, and an empty M, K or N: each named, not run."""
  impl = mosaic.MosaicGatedLinearUnit(interpret=True)
  x = jnp.ones((64, 128), jnp.bfloat16)
  w = jnp.ones((128, 2, 128), jnp.bfloat16)
  assert impl._unsupported_reason(spec.canonicalize(x, w)) is None
  for weights in (w.astype(jnp.float16), (w[:, 0], w[:, 1].astype(jnp.float16))):
    reason = impl._unsupported_reason(spec.canonicalize(x, weights))
    assert reason is not None and "weights dtype float16" in reason, reason
  for x_shape, w_shape in (((0, 128), (128, 2, 128)), ((64, 0), (0, 2, 128))):
    record = spec.canonicalize(jnp.ones(x_shape, jnp.bfloat16), jnp.ones(w_shape, jnp.bfloat16))
    reason = impl._unsupported_reason(record)
    assert reason is not None and "empty dimension" in reason, reason


def test_backward_reason_names_an_activation_derivative_mosaic_cannot_lower():
  """rem(1.5, g + 3) lowers in the epilogue, but its derivative needs floor: the forward runs
  in the kernel, the backward is refused with a reason."""
  impl = mosaic.MosaicGatedLinearUnit(interpret=True)
  activation = lambda g: jax.lax.rem(1.5, g + 3.0)
  record = spec.canonicalize(
    jnp.ones((64, 128), jnp.bfloat16), jnp.ones((128, 2, 128), jnp.bfloat16), activation=activation
  )
  assert impl._unsupported_reason(record) is None
  reason = impl._bwd_unsupported_reason(record)
  assert reason is not None and "derivative" in reason and "floor" in reason, reason
  plain = spec.canonicalize(
    jnp.ones((64, 128), jnp.bfloat16), jnp.ones((128, 2, 128), jnp.bfloat16), activation=jnp.tanh
  )
  assert impl._bwd_unsupported_reason(plain) is None


@pytest.mark.parametrize("tuple_weights", [False, True], ids=["fused", "pair"])
def test_backward_xla_matmuls_take_the_callers_precision(tuple_weights):
  """The backward's XLA matmuls (dx and dW; four for a weight pair) run at `precision`."""
  highest = jax.lax.Precision.HIGHEST
  x = jnp.ones((64, 128), jnp.bfloat16)
  w = jnp.ones((128, 2, 128), jnp.bfloat16)
  weights = (w[:, 0], w[:, 1]) if tuple_weights else w
  impl = mosaic.MosaicGatedLinearUnit(interpret=True, backward="xla")

  def f(a, b):
    out = api.gated_linear_unit(
      a, b, activation=jax.nn.swish, precision=highest, implementation=impl
    )
    return out.astype(jnp.float32).sum()

  jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, weights).jaxpr
  found = [
    e.params["precision"] for e in jaxprs.equations(jaxpr) if e.primitive.name == "dot_general"
  ]
  assert len(found) == (4 if tuple_weights else 2), found
  assert all(p == (highest, highest) for p in found), found


@pytest.mark.host_only
def test_interpret_gradients_fall_back_to_xla_where_the_derivative_cannot_lower(capfd):
  """g * rem(1.5, g + 10), i.e. 1.5 g for these gates: the forward runs in the kernel, the
  gradients come from XLA's derivative (the kernel's backward cannot apply the floor in
  rem's), both matching the reference."""
  activation = lambda g: g * jax.lax.rem(jnp.full_like(g, 1.5), g + 10.0)
  rng = np.random.default_rng(11)
  x = jnp.asarray(rng.standard_normal((64, 128)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((128, 2, 128)) / np.sqrt(128), jnp.bfloat16)
  impl = mosaic.MosaicGatedLinearUnit(interpret=True, config=SMALL)

  def fn(a, b):
    return api.gated_linear_unit(a, b, activation=activation, implementation=impl)

  out, vjp = jax.vjp(fn, x, w)
  ct = jnp.asarray(rng.standard_normal(out.shape), jnp.bfloat16)
  dx, dw = vjp(ct)
  ref, (ref_dx, ref_dw) = references.high_precision_vjp(
    lambda a, b: references.gated_linear_unit(a, b, activation=activation), (x, w), ct
  )
  assert "RACE DETECTED" not in capfd.readouterr().out
  assert compare.relative_error(out, ref) < 5e-3
  assert compare.relative_error(dx, ref_dx) < 1e-2
  assert compare.relative_error(dw, ref_dw) < 1e-2


@pytest.mark.host_only
def test_interpret_cluster_pairs_cover_every_column_tile(capfd):
  """Clusters of two CTAs over four column tiles (two pairs), with the residuals: each pair
  takes its own two tiles of both projections and of both residual halves."""
  rng = np.random.default_rng(13)
  k, n = 128, 256
  x = jnp.asarray(rng.standard_normal((64, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((k, 2, n)) / np.sqrt(k), jnp.bfloat16)
  impl = mosaic.MosaicGatedLinearUnit(
    interpret=True, config=dataclasses.replace(SMALL, cluster=2), backward="xla"
  )

  def fn(a, b):
    return api.gated_linear_unit(a, b, activation=jax.nn.swish, implementation=impl)

  out, vjp = jax.vjp(fn, x, w)  # The kernel that also writes the residuals.
  ct = jnp.asarray(rng.standard_normal(out.shape), jnp.bfloat16)
  dx, dw = vjp(ct)
  assert "RACE DETECTED" not in capfd.readouterr().out
  xf, wf, cf = (np.asarray(a, np.float64) for a in (x, w, ct))
  gate, up = xf @ wf[:, 0], xf @ wf[:, 1]
  sig = 1 / (1 + np.exp(-gate))
  act = gate * sig
  d_gate, d_up = cf * up * (sig + act * (1 - sig)), cf * act
  want_dw = np.stack([xf.T @ d_gate, xf.T @ d_up], axis=1)
  np.testing.assert_allclose(np.asarray(out, np.float64), act * up, rtol=2e-2, atol=2e-2)
  assert compare.relative_error(out, act * up) < 5e-3
  assert compare.relative_error(dx, d_gate @ wf[:, 0].T + d_up @ wf[:, 1].T) < 1e-2
  for j in range(2):  # Each projection's weights, a column tile at a time.
    for c in range(0, n, 64):
      got, want = dw[:, j, c : c + 64], want_dw[:, j, c : c + 64]
      assert compare.relative_error(got, want) < 1e-2, (j, c)


def test_kernel_config_reason_limits_of_k_and_shared_memory():
  """K in whole blocks; shared memory counts both projections' tiles per stage and, with
  residuals, the ring of two epilogue buffers."""
  cfg = lambda **kw: mosaic_kernel.MosaicGluKernelConfig(**{"block_n": 128, "epi_n": 128, **kw})
  m, n = 256, 256
  # 160 = 2.5 blocks of 64: whole stages for num_stages=2, but not whole blocks.
  reason = mosaic_kernel.config_reason(cfg(num_stages=2), m, 160, n, 2)
  assert reason is not None and "multiple of block_k" in reason, reason
  assert mosaic_kernel.config_reason(cfg(num_stages=2), m, 192, n, 2) is None
  # A stage: x's 128 rows and both projections' 128 columns, 64 deep: 48 KiB in bfloat16.
  assert mosaic_kernel.config_reason(cfg(num_stages=4), m, 512, n, 2) is None
  reason = mosaic_kernel.config_reason(cfg(num_stages=5), m, 512, n, 2)
  assert reason is not None and "shared memory" in reason, reason
  # With residuals, two 32 KiB epilogue buffers: three stages fit, four do not.
  assert mosaic_kernel.config_reason(cfg(num_stages=3), m, 512, n, 2, True) is None
  reason = mosaic_kernel.config_reason(cfg(num_stages=4), m, 512, n, 2, True)
  assert reason is not None and "shared memory" in reason, reason


def test_kernel_config_reason_names_wgmma_tiles_and_cluster_sizes():
  """block_k must span one 128-byte swizzle, block_n be a multiple of 64 up to 256, and a
  cluster hold one or two CTAs, however evenly N divides."""
  cfg = lambda **kw: mosaic_kernel.MosaicGluKernelConfig(
    **{"block_n": 128, "epi_n": 64, "num_stages": 2, **kw}
  )
  m, k = 256, 512
  assert mosaic_kernel.config_reason(cfg(), m, k, 512, 2) is None
  reason = mosaic_kernel.config_reason(cfg(block_k=32), m, k, 512, 2)
  assert reason is not None and "block_k=32" in reason, reason
  reason = mosaic_kernel.config_reason(cfg(block_n=96, epi_n=96), m, k, 192, 2)
  assert reason is not None and "block_n=96" in reason, reason
  reason = mosaic_kernel.config_reason(cfg(block_n=512, epi_n=64), m, k, 512, 2)
  assert reason is not None and "block_n=512" in reason, reason
  for cluster in (3, 4):  # N = 12 column tiles: whole clusters either way.
    reason = mosaic_kernel.config_reason(cfg(cluster=cluster), m, k, 12 * 128, 2)
    assert reason is not None and f"cluster={cluster}" in reason, reason


def test_unsupported_reason_judges_the_callers_config():
  """block_n=128 does not tile N=192 (the heuristic's 64 does): the op with that config
  refuses the shape, the heuristic one takes it."""
  x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
  record = spec.canonicalize(x, jax.ShapeDtypeStruct((128, 2, 192), jnp.bfloat16))
  wide = mosaic.MosaicGluConfig(block_n=128, num_stages=2, epi_n=64)
  reason = mosaic.MosaicGatedLinearUnit(config=wide)._unsupported_reason(record)
  assert reason is not None and "N=192" in reason, reason
  assert mosaic.MosaicGatedLinearUnit()._unsupported_reason(record) is None


@pytest.mark.parametrize(
  ("m", "k", "n"),
  [
    (8192, 4096, 14336),
    (8192, 4096, 192),
    (2048, 2048, 8192),
    (4096, 192, 4096),
    (512, 4096, 4096),
  ],
)
def test_heuristic_takes_the_deepest_pipeline_that_fits(m, k, n):
  """The heuristic config fits, and one more stage would not (or it has the 4 stages that
  large shapes take): no shallower pipeline than shared memory and K allow."""
  record = spec.canonicalize(
    jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, 2, n), jnp.bfloat16)
  )
  config = mosaic.MosaicGatedLinearUnit()._get_heuristics_config(record)
  assert mosaic._config_reason(record, config, False) is None, config
  if config.num_stages < 4:
    deeper = dataclasses.replace(config, num_stages=config.num_stages + 1)
    assert mosaic._config_reason(record, deeper, False) is not None, config
  # Stages over K: 4096 // 64 steps take 4 stages (6 for few rows), 192 // 64 only 3.
  assert config.num_stages == (3 if k == 192 else 6 if m <= 512 else 4), config


@pytest.mark.parametrize(
  ("m", "k", "n", "block_n", "stages", "epi_n"),
  [
    (8192, 4096, 14336, 128, 4, 128),
    (2048, 2048, 8192, 128, 4, 128),
    (512, 4096, 14336, 64, 6, 64),
    (8192, 4096, 192, 64, 4, 64),
  ],
)
def test_heuristic_is_the_documented_choice(m, k, n, block_n, stages, epi_n):
  """docs/perf_decisions.md, Gated linear unit: grid row-tile bands of 8 (2.68 against 3.07
  ms with 16) at every shape; few row tiles (M=512) take 64-column blocks, 6 stages and a
  64-column epilogue, measured against (128, 4, 128), which the other shapes take; N=192,
  which 128 does not tile, takes 64-column blocks."""
  record = spec.canonicalize(
    jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, 2, n), jnp.bfloat16)
  )
  config = mosaic.MosaicGatedLinearUnit()._get_heuristics_config(record)
  want = mosaic.MosaicGluConfig(
    block_n=block_n, num_stages=stages, epi_n=epi_n, grid_tile_m=8, cluster=1
  )
  assert config == want


def test_every_autotuning_config_is_supported():
  """The candidates tried on the device all pass the kernel's config checks."""
  op = mosaic.MosaicGatedLinearUnit()
  for m, k, n in ((512, 512, 256), (8192, 4096, 14336), (128, 192, 192)):
    record = spec.canonicalize(
      jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, 2, n), jnp.bfloat16)
    )
    configs = op._get_autotuning_configs(record)
    assert configs
    for config in configs:
      assert mosaic._config_reason(record, config, False) is None, (m, k, n, config)


def test_autotuning_tries_configs_only_the_plain_forward_fits():
  """At 8192x4096x14336 the heuristic's (128-column blocks, 4 stages, a 128-column epilogue)
  takes 4 x (128 + 2 x 128) x 64 x 2 + 2 x 64 x 128 x 2 = 229376 bytes of shared memory, under
  227 KiB less 1 KiB; the kernel that also writes the residuals (a ring of two epilogue
  buffers) would need 262144. The plain forward's candidates still include it."""
  m, k, n = 8192, 4096, 14336
  record = spec.canonicalize(
    jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, 2, n), jnp.bfloat16)
  )
  config = mosaic.MosaicGluConfig(block_n=128, num_stages=4, epi_n=128, grid_tile_m=8)
  assert config in mosaic.MosaicGatedLinearUnit()._get_autotuning_configs(record)


def test_rows_reach_the_kernel_padded_to_the_tma_row_tile(monkeypatch):
  """M rows are padded up to the next multiple of 8 (the TMA copies' row tiling), no more."""
  seen = []

  def kernel(x, w_gate, w_up, *, n, save_residuals=False, **_):
    del w_gate, w_up
    seen.append(x.shape[0])
    out = jnp.zeros((x.shape[0], n), x.dtype)
    return (out, jnp.zeros((x.shape[0], 2 * n), x.dtype)) if save_residuals else out

  monkeypatch.setattr(mosaic.mosaic_kernel, "gated_linear_unit", kernel)
  op = mosaic.MosaicGatedLinearUnit(interpret=True)
  w = jax.ShapeDtypeStruct((128, 2, 128), jnp.bfloat16)
  for m in range(1, 18):
    record = spec.canonicalize(jax.ShapeDtypeStruct((m, 128), jnp.bfloat16), w)
    out = jax.eval_shape(lambda r: op._run(r, SMALL, False), record)
    assert out.shape == (m, 128)
    assert seen[-1] % 8 == 0 and m <= seen[-1] < m + 8, (m, seen[-1])


@pytest.mark.parametrize(("m", "k", "n"), [(8192, 4096, 14336), (2048, 2048, 8192)])
def test_kernels_of_the_vjp_fit_shared_memory_with_their_epilogues(m, k, n, monkeypatch):
  """Under jax.vjp the kernel that also writes the residuals runs a config whose shared
  memory, residual epilogue ring included, fits; the kernel without them runs the op's own
  config (on a CPU the heuristic's, on an H200 the shipped tuned entry's); the backward is
  supported."""
  runs = []

  def kernel(x, w_gate, w_up, *, n, config, save_residuals=False, **_):
    del w_gate, w_up
    runs.append((config, save_residuals))
    out = jnp.zeros((x.shape[0], n), x.dtype)
    return (out, jnp.zeros((x.shape[0], 2 * n), x.dtype)) if save_residuals else out

  monkeypatch.setattr(mosaic.mosaic_kernel, "gated_linear_unit", kernel)
  op = mosaic.MosaicGatedLinearUnit(interpret=True)
  shapes = (
    jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
    jax.ShapeDtypeStruct((k, 2, n), jnp.bfloat16),
  )
  record = spec.canonicalize(*shapes, activation=jax.nn.swish)
  assert op._bwd_unsupported_reason(record) is None

  def fn(x, w):
    return api.gated_linear_unit(x, w, activation=jax.nn.swish, implementation=op)

  jax.eval_shape(fn, *shapes)
  jax.eval_shape(lambda x, w: jax.vjp(fn, x, w)[0], *shapes)
  assert [save for _, save in runs] == [False, True]
  for config, save in runs:
    assert mosaic_kernel.config_reason(config, m, k, n, 2, save) is None, (config, save)
  assert runs[0][0] == mosaic._kernel_config(jnp.bfloat16, op.resolve_config(record))


@pytest.mark.parametrize(
  "activation", [jax.nn.swish, jax.nn.gelu, jax.nn.sigmoid], ids=["swish", "gelu", "sigmoid"]
)
def test_activation_derivative_lowers_without_add_any(activation):
  """(act(g), u * act'(g)) in primitives Mosaic GPU lowers: the JVP's add_any, also inside
  the activation's own jit (swish, gelu), becomes add; the values are the derivative's."""
  g = jnp.linspace(-4.0, 4.0, 64 * 64, dtype=jnp.float32).reshape(64, 64)
  u = jnp.full_like(g, 0.5)
  jaxpr = jax.make_jaxpr(lambda a, b: mosaic_kernel.activation_and_derivative(activation, a, b))
  names = {e.primitive.name for e in jaxprs.equations(jaxpr(g, u).jaxpr)}
  assert not names & {"add_any", "pjit", "jit"}, names
  assert mosaic._activation_reason(activation, derivative=True) is None
  act, factor = mosaic_kernel.activation_and_derivative(activation, g, u)
  g64 = np.asarray(g, np.float64)
  sig = 1 / (1 + np.exp(-g64))
  if activation is jax.nn.swish:
    want_act, want_grad = g64 * sig, sig * (1 + g64 * (1 - sig))
  elif activation is jax.nn.sigmoid:
    want_act, want_grad = sig, sig * (1 - sig)
  else:  # gelu's tanh approximation.
    c = np.sqrt(2 / np.pi)
    t = np.tanh(c * (g64 + 0.044715 * g64**3))
    want_act = 0.5 * g64 * (1 + t)
    want_grad = 0.5 * (1 + t) + 0.5 * g64 * (1 - t**2) * c * (1 + 3 * 0.044715 * g64**2)
  np.testing.assert_allclose(act, want_act, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(factor, 0.5 * want_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("tuple_weights", [False, True], ids=["fused", "pair"])
def test_cotangents_come_back_in_the_inputs_dtypes(tuple_weights, dtype):
  """dx and dW in x's and the weights' dtype (the backward matmuls accumulate in float32)."""
  x = jax.ShapeDtypeStruct((64, 128), dtype)
  w = jax.ShapeDtypeStruct((128, 2, 128), dtype)
  halves = jax.ShapeDtypeStruct((128, 128), dtype)
  weights = (halves, halves) if tuple_weights else w
  impl = mosaic.MosaicGatedLinearUnit(interpret=True, config=SMALL)

  def grads(a, b):
    fn = lambda a, b: api.gated_linear_unit(a, b, activation=jax.nn.swish, implementation=impl)
    out, vjp = jax.vjp(fn, a, b)
    return vjp(jnp.ones_like(out))

  dx, dw = jax.eval_shape(grads, x, weights)
  assert (dx.shape, dx.dtype) == (x.shape, x.dtype)
  assert jax.tree.structure(dw) == jax.tree.structure(weights)
  for got, want in zip(jax.tree.leaves(dw), jax.tree.leaves(weights), strict=True):
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
