"""The Hopper GEMM skeleton shared by the Mosaic GPU matmul kernels: its limits, on any host.

The tile, shared-memory and SM-count rules, checked against the sm_90 numbers they stand
for, and the ping-pong schedule on a plain GEMM in the interpreter; the kernels themselves
run in suites/kernels/test_mosaic_*.py.
"""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from tokamax._src.ops import mosaic_gemm


@dataclasses.dataclass(frozen=True)
class _Config:
  block_n: int = 128
  block_k: int = 64
  epi_n: int = 64
  cluster: int = 1


def test_shared_memory_fits_an_sm90_block():
  """sm_90 gives one CTA at most 227 KiB of shared memory; the limit keeps 1 KiB of it."""
  assert mosaic_gemm.SMEM_BYTES == 227 * 1024 - 1024
  assert mosaic_gemm.smem_reason(_Config(), 227 * 1024 - 1024) is None
  reason = mosaic_gemm.smem_reason(_Config(), 227 * 1024 - 1023)
  assert reason is not None and "shared memory" in reason


@pytest.mark.parametrize("block_n", [64, 128, 192, 256])
def test_wgmma_takes_block_n_of_every_multiple_of_64_up_to_256(block_n):
  """wgmma's N is a multiple of 8 up to 256; the skeleton's stores take 64-column steps."""
  assert mosaic_gemm.tile_reason(_Config(block_n=block_n), "block_k", 2) is None


@pytest.mark.parametrize("block_n", [32, 96, 320, 512])
def test_wgmma_refuses_other_block_n(block_n):
  reason = mosaic_gemm.tile_reason(_Config(block_n=block_n), "block_k", 2)
  assert reason is not None and f"block_n={block_n}" in reason


@pytest.mark.parametrize(("itemsize", "depth"), [(1, 128), (2, 64), (4, 32)])
def test_the_contraction_depth_spans_128_bytes(itemsize, depth):
  assert mosaic_gemm.swizzle_elems({1: "int8", 2: "bfloat16", 4: "float32"}[itemsize]) == depth
  assert mosaic_gemm.tile_reason(_Config(block_k=depth), "block_k", itemsize) is None
  for other in (depth // 2, depth * 2):
    reason = mosaic_gemm.tile_reason(_Config(block_k=other), "block_k", itemsize)
    assert reason is not None and f"block_k={other}" in reason


def test_persistent_ctas_are_the_gpus_sms(monkeypatch):
  """One CTA per SM of the GPU at hand (an H100 PCIe has 114), an H200's 132 without one, few
  when interpreted."""
  gpu = types.SimpleNamespace(platform="gpu", core_count=114)
  monkeypatch.setattr(mosaic_gemm.device_lib, "default_device", lambda: gpu)
  assert mosaic_gemm.num_sms() == 114
  assert mosaic_gemm.num_sms(interpret=True) == mosaic_gemm.INTERPRET_NUM_SMS == 2
  cpu = types.SimpleNamespace(platform="cpu", core_count=8)
  monkeypatch.setattr(mosaic_gemm.device_lib, "default_device", lambda: cpu)
  assert mosaic_gemm.num_sms() == 132


@pytest.mark.parametrize(("cluster", "grid"), [(1, (132,)), (2, (66,))])
def test_the_kernel_grid_counts_clusters_of_ctas(monkeypatch, cluster, grid):
  """132 SMs in clusters of two CTAs: a grid of 66 clusters."""
  seen = {}
  monkeypatch.setattr(mosaic_gemm.plgpu, "kernel", lambda body, **kwargs: seen.update(kwargs))
  mosaic_gemm.kernel(lambda: None, None, num_sms=132, cluster=cluster)
  assert seen["grid"] == grid
  assert seen.get("cluster", (1,)) == (cluster,)
  assert seen["num_threads"] == 3


@pytest.mark.parametrize(("dtype", "columns"), [("bfloat16", 64), ("float32", 32), ("int8", 128)])
def test_operand_tiles_are_swizzle_atoms(dtype, columns):
  """A 128-byte swizzle permutes atoms of 8 rows of 128 bytes; the TMA tile is one atom."""
  tiling, swizzle = mosaic_gemm.transforms(jnp.dtype(dtype))
  assert tiling == plgpu.TilingTransform((8, columns))
  assert swizzle == plgpu.SwizzleTransform(128)


@pytest.mark.parametrize("approx_math", [False, True])
def test_the_kernel_lowers_with_the_math_asked_for(monkeypatch, approx_math):
  """The GLU and loss kernels ask for approximate exp2 and log; the ragged dot does not."""
  seen = {}
  monkeypatch.setattr(mosaic_gemm.plgpu, "kernel", lambda body, **kwargs: seen.update(kwargs))
  mosaic_gemm.kernel(lambda: None, None, num_sms=132, approx_math=approx_math)
  assert seen["compiler_params"].approx_math is approx_math
  assert seen["compiler_params"].lowering_semantics == plgpu.LoweringSemantics.Warpgroup


def _pingpong_gemm(x, w, depth_steps, *, num_stages, in_flight, num_sms=2):
  """out[i] = x[rows i, :64 d_i] @ w[:64 d_i, :] for each 128-row tile i, through
  `mosaic_gemm.pingpong` with d_i = depth_steps[i] steps of 64 (0: a tile of zeros)."""
  m, n = x.shape[0], w.shape[1]
  tiles = m // 128

  def kernel(steps_ref, x_ref, w_ref, out_ref):
    sm = jax.lax.axis_index("sm")
    tile = lambda j: sm + j * num_sms

    def load(j, s, slots, barrier):
      ks = pl.ds(s * 64, 64)
      plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(tile(j) * 128, 128), ks], slots[0], barrier)
      plgpu.copy_gmem_to_smem(w_ref.at[ks, :], slots[1], barrier)

    @functools.partial(
      pl.run_scoped,
      pipeline=mosaic_gemm.pingpong_allocations(
        (((128, 64), x.dtype), ((64, n), w.dtype)), num_stages
      ),
      o_smem=plgpu.SMEM((2, 128, n), jnp.float32),
      collective_axes="wg",
    )
    def scope(pipeline, o_smem):
      o_wg = o_smem.at[jax.lax.axis_index("wg")]

      def compute(j, run):
        def acc_scope(acc):
          run(lambda s, slots: plgpu.wgmma(acc, *slots))
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          o_wg[...] = acc[...]
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(o_wg, out_ref.at[pl.ds(tile(j) * 128, 128)])

        pl.run_scoped(acc_scope, plgpu.ACC((128, n), jnp.float32))

      mosaic_gemm.pingpong(
        **pipeline,
        count=jax.lax.div(tiles - sm + num_sms - 1, num_sms),
        steps=lambda j: steps_ref[tile(j)],
        load=load,
        compute=compute,
        num_stages=num_stages,
        in_flight=in_flight,
      )
      plgpu.wait_smem_to_gmem(0)

  call = mosaic_gemm.kernel(
    kernel,
    jax.ShapeDtypeStruct((m, n), jnp.float32),
    num_sms=num_sms,
    interpret=plgpu.InterpretGPUParams(detect_races=True),
  )
  return call(jnp.asarray(depth_steps, jnp.int32), x, w)


@pytest.mark.parametrize(
  ("depth_steps", "num_stages", "in_flight"),
  [
    ((3, 1, 4, 2, 5), 2, 1),  # Five tiles on two CTAs: three items on one, two on the other.
    ((2, 0, 3, 0, 1, 4, 0), 3, 0),  # Empty items (no step, zeros out) on both warpgroups.
    ((1, 1, 1), 2, 1),  # Items shorter than the ring.
  ],
)
@pytest.mark.host_only
def test_pingpong_runs_each_items_steps_on_its_warpgroup(depth_steps, num_stages, in_flight, capfd):
  """Items of different depths (so each warpgroup's
  next item starts at a position that depends on the other's), interpreted with race
  detection, against float64 per tile."""
  tiles, n = len(depth_steps), 64
  rng = np.random.default_rng(len(depth_steps))
  x = jnp.asarray(rng.standard_normal((tiles * 128, 64 * max(depth_steps))), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((64 * max(depth_steps), n)), jnp.bfloat16)
  out = _pingpong_gemm(x, w, depth_steps, num_stages=num_stages, in_flight=in_flight)
  assert not interpret_pallas_call.get_races().races_found
  assert "RACE DETECTED" not in capfd.readouterr().out
  a, b = np.asarray(x, np.float64), np.asarray(w, np.float64)
  for i, d in enumerate(depth_steps):
    want = a[i * 128 : (i + 1) * 128, : 64 * d] @ b[: 64 * d]
    np.testing.assert_allclose(np.asarray(out[i * 128 : (i + 1) * 128]), want, rtol=1e-5, atol=1e-4)
