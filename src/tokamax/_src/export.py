"""Support for `jax.export` of functions that contain tokamax kernels."""

import jax

# Custom calls emitted by the kernel implementations; they are stable for a given
# jaxlib, so exported functions may contain them.
KERNEL_CUSTOM_CALL_TARGETS = (
  "triton_kernel_call",  # jax-triton
  "mosaic_gpu",  # Pallas Mosaic GPU
  "mosaic_gpu_v2",
  "tpu_custom_call",  # Pallas Mosaic TPU
  "__cudnn$fmhaSoftmax",  # cuDNN attention
  "__cudnn$fmhaScaleBiasSoftmax",
  "__cudnn$fmhaScaleMaskSoftmax",
  "__cudnn$fmhaScaleBiasMaskSoftmax",
  "__cudnn$fmhaSoftmaxBackward",
  "__cudnn$fmhaScaleBiasSoftmaxBackward",
  "__cudnn$fmhaScaleMaskSoftmaxBackward",
  "__cudnn$fmhaScaleBiasMaskSoftmaxBackward",
)

DISABLE_JAX_EXPORT_CHECKS = tuple(
  jax.export.DisabledSafetyCheck.custom_call(target) for target in KERNEL_CUSTOM_CALL_TARGETS
)
