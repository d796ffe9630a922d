"""Facts about the accelerator at hand."""

import functools

import jax


def default_device() -> jax.Device:
  return jax.devices()[0]


def platform() -> str:
  """The platform lowerings target: the abstract mesh's device's, else the default backend."""
  abstract = jax.sharding.get_abstract_mesh().abstract_device
  return abstract.platform if abstract is not None else jax.default_backend()


@functools.cache
def _compute_capability_of(device: jax.Device) -> tuple[int, int] | None:
  value = getattr(device, "compute_capability", None)
  if value is None:
    return None
  major, minor = str(value).split(".")
  return int(major), int(minor)


def compute_capability(device: jax.Device | None = None) -> tuple[int, int] | None:
  """The CUDA compute capability of `device`, or None off NVIDIA GPUs."""
  device = device or default_device()
  if device.platform != "gpu":
    return None
  return _compute_capability_of(device)


def is_nvidia_gpu(device: jax.Device | None = None) -> bool:
  return compute_capability(device) is not None


def has_sm(major: int, minor: int = 0, device: jax.Device | None = None) -> bool:
  """Whether `device` is an NVIDIA GPU of compute capability >= major.minor."""
  cc = compute_capability(device)
  return cc is not None and cc >= (major, minor)
