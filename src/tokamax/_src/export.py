"""Support for `jax.export` of functions that contain tokamax kernels.

`jax.export` refuses custom calls that JAX does not guarantee to be stable.
The kernel implementations emit a few such custom calls; an exported function
that contains them runs only on the device kind and jaxlib it was exported for
(which is what tokamax's kernels require anyway). Pass
`disabled_checks=DISABLE_JAX_EXPORT_CHECKS` to allow them:

  exp = jax.export.export(jax.jit(f), disabled_checks=DISABLE_JAX_EXPORT_CHECKS)(*args)

`abstract_gpu()` lets a machine without a GPU lower for CUDA (to inspect or
export Pallas Triton kernels) by naming the GPU that the lowering targets;
`abstract_tpu()` does the same for TPUs (Pallas Mosaic TPU kernels, which
`implementation=None` then prefers):

  with abstract_tpu():
    exp = jax.export.export(jax.jit(f), platforms=("tpu",))(*args)
"""

import contextlib
import re
from collections.abc import Iterator

import jax

from tokamax._src import device as device_lib

# Custom calls emitted by kernel implementations, by where they come from.
TRITON_CUSTOM_CALL_TARGETS = (
  "triton_kernel_call",  # jax-triton's `triton_call`.
  "__gpu$xla.gpu.triton",  # Pallas kernels lowered through Triton.
)
MOSAIC_CUSTOM_CALL_TARGETS = (
  "mosaic_gpu_v2",  # Pallas Mosaic GPU (jax >= 0.7; stable in jax 0.11, listed for older).
  "mosaic_gpu",  # Pallas Mosaic GPU before "mosaic_gpu_v2".
  "tpu_custom_call",  # Pallas Mosaic TPU.
)
# The fused attention calls of `jax.nn.dot_product_attention(implementation="cudnn")`.
CUDNN_CUSTOM_CALL_TARGETS = tuple(
  f"__cudnn$fmha{name}"
  for name in (
    "Softmax",
    "ScaleBiasSoftmax",
    "SoftmaxDropout",
    "ScaleBiasSoftmaxDropout",
    "SoftmaxF8",
    "SoftmaxBackward",
    "ScaleBiasSoftmaxBackward",
    "SoftmaxDropoutBackward",
    "ScaleBiasSoftmaxDropoutBackward",
    "SoftmaxBackwardF8",
  )
)
KERNEL_CUSTOM_CALL_TARGETS = (
  *TRITON_CUSTOM_CALL_TARGETS,
  *MOSAIC_CUSTOM_CALL_TARGETS,
  *CUDNN_CUSTOM_CALL_TARGETS,
)

DISABLE_JAX_EXPORT_CHECKS = tuple(
  jax.export.DisabledSafetyCheck.custom_call(target) for target in KERNEL_CUSTOM_CALL_TARGETS
)

_CUSTOM_CALL = re.compile(r"stablehlo\.custom_call @([^\s(]+)\(|call_target_name = \"([^\"]+)\"")


def custom_call_targets(module: "jax.export.Exported | str") -> set[str]:
  """The custom call targets in an exported function or StableHLO text."""
  text = module if isinstance(module, str) else module.mlir_module()
  return {a or b for a, b in _CUSTOM_CALL.findall(text)}


def kernel_custom_calls(module: "jax.export.Exported | str") -> set[str]:
  """The tokamax kernel custom calls in an exported function or StableHLO text."""
  return custom_call_targets(module) & set(KERNEL_CUSTOM_CALL_TARGETS)


@contextlib.contextmanager
def abstract_gpu(
  device_kind: str = "NVIDIA H200", num_cores: int = device_lib.DEFAULT_SM_COUNT
) -> Iterator[None]:
  """Lowerings inside target this GPU, also on a machine that has none.

  Pallas Triton lowering asks for the GPU's compute capability; JAX takes it
  from the abstract mesh's device. Kernels that need the GPU plugin to lower
  (Mosaic GPU, jax-triton, cuDNN) still need a GPU machine.
  """
  from jax._src import mesh as mesh_lib

  device = mesh_lib.AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="gpu")
  mesh = mesh_lib.AbstractMesh((1,), ("_tokamax_export",), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    yield


@contextlib.contextmanager
def abstract_tpu(device_kind: str = "TPU v5 lite", num_cores: int = 1) -> Iterator[None]:
  """Lowerings inside target this TPU (default v5e), also on a machine that has none.

  Pallas Mosaic TPU kernels and the ops' implementation choice take the target
  from the abstract mesh's device.
  """
  device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="tpu")
  mesh = jax.sharding.AbstractMesh((1,), ("_tokamax_export",), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    yield
