"""The platform rules of the kernel base classes (Triton, Mosaic GPU, Mosaic TPU), on any host.

Each rule is asked about a platform by name, so no kernel compiles and no GPU or TPU is needed.
"""

import jax
import jax.numpy as jnp
import pytest

from tokamax._src import triton_call
from tokamax._src.ops import kernel_ops
from tokamax._src.ops.normalization import triton as norm_triton
from tokamax._src.ops.ragged_dot import mosaic, mosaic_tpu


def test_mosaic_gpu_refuses_a_gpu_without_a_cuda_compute_capability(monkeypatch):
  """A "gpu" platform that is not an NVIDIA GPU (no compute capability) has no wgmma."""
  monkeypatch.setattr(kernel_ops.device_lib, "compute_capability", lambda _device: None)
  reason = mosaic.MosaicRaggedDot()._platform_reason("gpu", None)
  assert reason is not None and "NVIDIA GPU" in reason, reason


def test_compiled_mosaic_gpu_refuses_other_platforms_naming_them():
  impl = mosaic.MosaicRaggedDot()
  for platform in ("cpu", "tpu"):
    reason = impl._platform_reason(platform, None)
    assert reason is not None and f"gpu, not on {platform}" in reason, reason


def test_interpreted_mosaic_gpu_runs_on_cpu_and_gpu_hosts():
  impl = mosaic.MosaicRaggedDot(interpret=True)
  assert impl._platform_reason("cpu", None) is None
  assert impl._platform_reason("gpu", None) is None
  reason = impl._platform_reason("tpu", None)
  assert reason is not None and "not tpu" in reason, reason


def test_mosaic_tpu_runs_on_a_tpu_or_interpreted_anywhere():
  compiled, interpreted = (
    mosaic_tpu.MosaicTpuRaggedDot(),
    mosaic_tpu.MosaicTpuRaggedDot(interpret=True),
  )
  assert compiled._platform_reason("tpu", None) is None
  for platform in ("cpu", "gpu"):
    reason = compiled._platform_reason(platform, None)
    assert reason is not None and f"not on {platform}" in reason, reason
    assert interpreted._platform_reason(platform, None) is None


def test_triton_runs_on_gpus_unless_interpreted():
  """Compiled, Triton needs an NVIDIA GPU; in Triton's interpreter a CPU or GPU host does."""
  impl = norm_triton.TritonLayerNorm()
  for platform in ("cpu", "tpu"):
    reason = impl._platform_reason(platform, None)
    assert reason is not None and f"not on {platform}" in reason, reason
  with triton_call.interpret():
    assert impl._platform_reason("cpu", None) is None
    assert impl._platform_reason("gpu", None) is None
    reason = impl._platform_reason("tpu", None)
    assert reason is not None and "not tpu" in reason, reason


def test_interpreted_triton_keeps_the_kernels_own_reasons():
  """Inside Triton's interpreter the kernel's checks still apply, after the interpreter's own
  (bfloat16) and the platform's."""
  if jax.default_backend() == "tpu":
    pytest.skip("Triton's interpreter runs on CPU and GPU hosts")
  impl = norm_triton.TritonLayerNorm()
  record = lambda shape, dtype: impl.bind(jnp.ones(shape, dtype), None, None).args
  with triton_call.interpret():
    assert impl.unsupported_reason(record((4, 8), jnp.float32)) is None
    assert impl.unsupported_reason(record((0, 8), jnp.float32)) == "empty input"
    assert "interpreter" in impl.unsupported_reason(record((4, 8), jnp.bfloat16))
    # One bfloat16 array is enough (here the scale).
    mixed = impl.bind(jnp.ones((4, 8), jnp.float32), jnp.ones((8,), jnp.bfloat16), None).args
    assert "interpreter" in impl.unsupported_reason(mixed)
