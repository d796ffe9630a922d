"""Triton autotuning candidates fit the shared memory of the GPU they are built for.

The candidates of ragged_dot, the GLU and the norms are compiled for sm_89 (L40S, RTX 4090:
99 KiB a block) with that GPU as the target; candidates that cannot launch there would only
be recorded as failures by the autotuner. The compiler's report is the reference.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from suites.kernels.gpu_limits import SMEM_LIMIT
from tokamax._src import device, triton_call
from tokamax._src.ops.gated_linear_unit import spec as glu_spec
from tokamax._src.ops.gated_linear_unit import triton as glu_triton
from tokamax._src.ops.normalization import spec as norm_spec
from tokamax._src.ops.normalization import triton as norm_triton
from tokamax._src.ops.ragged_dot import spec as ragged_spec
from tokamax._src.ops.ragged_dot import triton as ragged_triton

SM = 89


@pytest.fixture
def sm89(monkeypatch):
  """Kernels are built for an sm_89 GPU."""
  monkeypatch.setattr(device, "target_compute_capability", lambda: (8, 9))


def _shared(launch, sm=SM) -> int:
  return triton_call.compile_launch(launch, sm).metadata.shared


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_ragged_dot_candidates_fit_sm89(sm89, dtype):
  rng = np.random.default_rng(0)
  lhs = jnp.asarray(rng.standard_normal((512, 256)), dtype)
  rhs = jnp.asarray(rng.standard_normal((4, 256, 512)), dtype)
  args = ragged_spec.canonicalize(
    lhs, rhs, jnp.array([100, 0, 300, 112], jnp.int32), ragged_spec.dimension_numbers("default")
  )
  op = ragged_triton.TritonRaggedDot()
  configs = op._get_autotuning_configs(args)
  assert len(configs) > 4
  for config in configs:
    with triton_call.capture() as launches:
      op._fwd(args, config)
    assert _shared(launches[0]) <= SMEM_LIMIT[SM], config


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gated_linear_unit_candidates_fit_sm89(sm89, dtype):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((256, 512)), dtype)
  w = jnp.asarray(rng.standard_normal((512, 2, 512)), dtype)
  args = glu_spec.canonicalize(x, w, activation=jax.nn.swish)
  op = glu_triton.TritonGatedLinearUnit()
  configs = op._get_autotuning_configs(args)
  assert len(configs) > 4
  for config in configs:
    with triton_call.capture() as launches:
      glu_triton.forward(args, config, False)
    assert _shared(launches[0]) <= SMEM_LIMIT[SM], config


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_norm_pipelined_candidates_fit_sm89(sm89, dtype):
  """Rows of 8192: the candidates that pipeline rows through shared memory, forward and
  backward, each at its most rows in flight."""
  x = jnp.ones((2048, 8192), dtype)  # More rows than persistent programs.
  args = norm_spec.canonicalize(x, jnp.ones(8192, dtype), None, axis=-1, subtract_mean=True)
  op = norm_triton.TritonLayerNorm()
  configs = op._get_autotuning_configs(args) | {op._get_heuristics_config(args)}

  def run(args, config):
    out, residuals = op._fwd(args, config)
    return out, op._bwd(args, config, out, residuals, jnp.ones_like(args.x))

  staged = [c for c in configs if c.fwd_stages > 1 or c.bwd_stages > 1]
  assert staged
  seen = set()
  for config in staged:
    with triton_call.capture() as launches:
      jax.eval_shape(lambda a, c=config: run(a, c), args)
    for launch in launches:
      key = (launch.kernel.__name__, tuple(sorted(launch.meta.items())))
      if key not in seen and launch.meta.get("STAGES", 0) > 1:
        seen.add(key)
        assert _shared(launch) <= SMEM_LIMIT[SM], (config, launch.meta)
  assert seen


@pytest.mark.parametrize("sm", [80, 89, 90])
@pytest.mark.parametrize(
  ("block_m", "block_n", "block_k", "stages"), [(128, 256, 64, 4), (128, 64, 64, 3)]
)
def test_pipeline_model_matches_the_compiler(monkeypatch, sm, block_m, block_n, block_k, stages):
  """`pipeline_fits` counts the bytes the compiler allocates for the ragged_dot kernel's
  matmul loop (bfloat16): it fits a block of exactly those bytes and not one byte less."""
  rng = np.random.default_rng(0)
  args = ragged_spec.canonicalize(
    jnp.asarray(rng.standard_normal((512, 256)), jnp.bfloat16),
    jnp.asarray(rng.standard_normal((4, 256, 512)), jnp.bfloat16),
    jnp.array([128, 128, 128, 128], jnp.int32),
    ragged_spec.dimension_numbers("default"),
  )
  config = ragged_triton.TritonRaggedDotConfig(
    block_m, block_n, block_k, num_warps=8, num_stages=stages
  )
  with triton_call.capture() as launches:
    ragged_triton.TritonRaggedDot()._fwd(args, config)
  shared = _shared(launches[0], sm)
  stage_bytes = (block_m * block_k + block_k * block_n) * 2
  cc = divmod(sm, 10)
  seen = []

  def limit(at):
    seen.append(tuple(at))
    return shared

  monkeypatch.setattr(device, "shared_memory_per_block", limit)
  assert triton_call.pipeline_fits(stage_bytes, stages, cc)
  monkeypatch.setattr(device, "shared_memory_per_block", lambda at: shared - 1)
  assert not triton_call.pipeline_fits(stage_bytes, stages, cc)
  assert seen == [cc]
