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


# Shared memory one block may opt into, in bytes, by compute capability (the CUDA
# programming guide's technical specifications): Ampere's A100 and Orin 163 KiB, the
# consumer and workstation parts (sm_86, sm_89, sm_120, sm_121) 99 KiB, Hopper and the
# data-centre Blackwells 227 KiB.
_SHARED_MEMORY_PER_BLOCK = {
  (8, 0): 166912,
  (8, 6): 101376,
  (8, 7): 166912,
  (8, 9): 101376,
  (9, 0): 232448,
  (10, 0): 232448,
  (10, 3): 232448,
  (11, 0): 232448,
  (12, 0): 101376,
  (12, 1): 101376,
}
_SMALLEST_SHARED_MEMORY_PER_BLOCK = min(_SHARED_MEMORY_PER_BLOCK.values())
# What kernels lowered without an NVIDIA GPU at hand target.
DEFAULT_COMPUTE_CAPABILITY = (9, 0)


def shared_memory_per_block(cc: tuple[int, int] | None = None) -> int:
  """Bytes of shared memory one block may use.

  Args:
    cc: A compute capability; by default the default device's, or sm_90's off
      NVIDIA GPUs. Capabilities not in the table get the smallest limit.
  """
  cc = target_compute_capability() if cc is None else cc
  return _SHARED_MEMORY_PER_BLOCK.get(tuple(cc), _SMALLEST_SHARED_MEMORY_PER_BLOCK)


def target_compute_capability() -> tuple[int, int]:
  """The compute capability kernels are built for: the default device's, else sm_90's."""
  return compute_capability() or DEFAULT_COMPUTE_CAPABILITY


# SMs of an H100/H200 SXM: what kernels lowered without a GPU at hand are sized for.
DEFAULT_SM_COUNT = 132


def sm_count(device: jax.Device | None = None) -> int:
  """Streaming multiprocessors of `device`, by default the abstract mesh's GPU (see
  `export.abstract_gpu`) or else the default device's; `DEFAULT_SM_COUNT` off GPUs."""
  count = None
  abstract = jax.sharding.get_abstract_mesh().abstract_device
  if device is None and abstract is not None:
    count = abstract.num_cores if abstract.platform == "gpu" else None
  else:
    device = device or default_device()
    count = getattr(device, "core_count", None) if device.platform == "gpu" else None
  return int(count) if count else DEFAULT_SM_COUNT


def is_nvidia_gpu(device: jax.Device | None = None) -> bool:
  return compute_capability(device) is not None


def has_sm(major: int, minor: int = 0, device: jax.Device | None = None) -> bool:
  """Whether `device` is an NVIDIA GPU of compute capability >= major.minor."""
  cc = compute_capability(device)
  return cc is not None and cc >= (major, minor)
