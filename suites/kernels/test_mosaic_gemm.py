"""The Hopper GEMM skeleton shared by the Mosaic GPU matmul kernels: its limits, on any host.

The tile, shared-memory and SM-count rules, checked against the sm_90 numbers they stand
for; the kernels themselves run in suites/kernels/test_mosaic_*.py.
"""

import dataclasses
import types

import jax.numpy as jnp
import pytest
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


class _Rows:
  """A ref whose `.at[pl.ds(start, n)]` is (name, start, n)."""

  def __init__(self, name):
    self.name = name

  @property
  def at(self):
    return self

  def __getitem__(self, ds):
    return self.name, int(ds.start), int(ds.size)


@pytest.mark.parametrize("max_rows", [64, 100])
def test_the_store_ladder_stores_any_row_count_in_power_of_two_copies(monkeypatch, max_rows):
  """Rows [first, first + size) go out in power-of-two TMA stores (static shapes), one rung per
  power of two from the largest up to `max_rows` down to 1, each to the same rows past row0."""
  rungs, copies = [], []

  def when(condition):
    rungs.append(bool(condition))
    if len(rungs) > 64:
      raise AssertionError("the ladder does not end")
    return lambda f: f() if condition else None

  monkeypatch.setattr(mosaic_gemm.pl, "when", when)
  monkeypatch.setattr(mosaic_gemm.plgpu, "copy_smem_to_gmem", lambda s, g: copies.append((s, g)))
  for size in range(max_rows + 1):
    for first in (0, 3):
      rungs.clear()
      copies.clear()
      mosaic_gemm.store_rows(_Rows("smem"), _Rows("gmem"), 1000, first, size, max_rows)
      assert len(rungs) == max_rows.bit_length(), (size, first)
      rows = []
      for (_, s_start, s_n), (_, g_start, g_n) in copies:
        assert s_n == g_n and s_n & (s_n - 1) == 0, (size, first, copies)
        assert g_start == 1000 + s_start
        rows += range(s_start, s_start + s_n)
      assert rows == list(range(first, first + size)), (size, first, copies)
