"""The hardware at hand, as a profile that tests and suites select on.

A profile names the platform, the device kind, the hardware family whose
matrix applies (`h100` covers H100 and H200, `a100`, `tpu_v5`, `cpu`), the
compute capability, the device memory, and which families of implementation
can run here.
"""

import dataclasses
import functools
import os

import jax

FAMILIES = ("h100", "a100", "tpu_v5", "cpu")

# Implementation families an implementation may belong to.
XLA = "xla"
CUDNN = "cudnn"
TRITON = "triton"
MOSAIC_GPU = "mosaic_gpu"
MOSAIC_TPU = "mosaic_tpu"
INTERPRET = "interpret"


@dataclasses.dataclass(frozen=True)
class Profile:
  """What the tests need to know about the accelerator.

  Attributes:
    platform: "cpu", "gpu" or "tpu".
    device_kind: As reported by JAX, e.g. "NVIDIA H200".
    family: The matrix to run: one of `FAMILIES`.
    compute_capability: (major, minor) on NVIDIA GPUs, else None.
    memory_bytes: Device memory, or None where JAX does not report it.
    device_count: Number of local devices.
    has_f64: Whether float64 computes natively (not on TPU).
    runnable: Implementation families that can run here.
  """

  platform: str
  device_kind: str
  family: str
  compute_capability: tuple[int, int] | None
  memory_bytes: int | None
  device_count: int
  has_f64: bool
  runnable: frozenset[str]

  def can_run(self, family: str) -> bool:
    return family in self.runnable

  def reason_cannot_run(self, family: str) -> str | None:
    """Why implementations of `family` cannot run here, or None."""
    if family in self.runnable:
      return None
    need = {
      MOSAIC_GPU: "Mosaic GPU needs an NVIDIA GPU with sm_90",
      TRITON: "Triton needs an NVIDIA GPU with sm_80 or newer",
      CUDNN: "cuDNN needs an NVIDIA GPU",
      MOSAIC_TPU: "Mosaic TPU needs a TPU",
      INTERPRET: "interpret mode runs on CPU",
    }.get(family, f"{family} cannot run here")
    return f"{need}; this is {self.describe()}"

  def describe(self) -> str:
    cc = (
      f" sm_{self.compute_capability[0]}{self.compute_capability[1]}"
      if self.compute_capability
      else ""
    )
    return f"{self.device_kind} ({self.platform}{cc}, family {self.family})"

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["runnable"] = sorted(self.runnable)
    return d


def family_of(platform: str, device_kind: str) -> str:
  """The matrix family for a device: h100 (H100, H200), a100, tpu_v5, cpu.

  Accelerators outside the known families fall back to the nearest matrix:
  other NVIDIA GPUs to `a100`, other TPUs to `tpu_v5`.
  """
  kind = device_kind.lower()
  if platform == "gpu":
    if "h100" in kind or "h200" in kind or "h800" in kind or "gh200" in kind:
      return "h100"
    return "a100"
  if platform == "tpu":
    return "tpu_v5"
  return "cpu"


def _memory_bytes(dev: jax.Device) -> int | None:
  try:
    stats = dev.memory_stats()
  except Exception:  # Some backends raise instead of returning None.
    return None
  return None if not stats else stats.get("bytes_limit")


def _compute_capability(dev: jax.Device) -> tuple[int, int] | None:
  """The CUDA compute capability of an NVIDIA GPU, else None."""
  value = getattr(dev, "compute_capability", None) if dev.platform == "gpu" else None
  if value is None:
    return None
  major, minor = str(value).split(".")
  return int(major), int(minor)


@functools.cache
def detect() -> Profile:
  """The profile of the default device; `TOKAMAX_FAMILY` overrides the family."""
  dev = jax.devices()[0]
  platform = dev.platform
  cc = _compute_capability(dev)
  runnable = {XLA}
  if platform == "cpu":
    runnable.add(INTERPRET)
  if cc is not None:
    runnable.add(CUDNN)
    if cc >= (8, 0):
      runnable.add(TRITON)
    if cc >= (9, 0):
      runnable.add(MOSAIC_GPU)
  if platform == "tpu":
    runnable.add(MOSAIC_TPU)
  family = os.environ.get("TOKAMAX_FAMILY") or family_of(platform, dev.device_kind)
  if family not in FAMILIES:
    raise ValueError(f"TOKAMAX_FAMILY={family!r} is not one of {FAMILIES}.")
  return Profile(
    platform=platform,
    device_kind=dev.device_kind,
    family=family,
    compute_capability=cc,
    memory_bytes=_memory_bytes(dev),
    device_count=jax.local_device_count(),
    has_f64=platform != "tpu",
    runnable=frozenset(runnable),
  )


def implementation_family(module_path: str) -> str:
  """The implementation family from a registered "module:Class" path.

  `...attention.mosaic:...` is Mosaic GPU on GPU builds (this library's Mosaic
  kernels target Hopper); `cudnn`, `triton` and `xla*` map to themselves.
  """
  module = module_path.split(":")[0].rsplit(".", 1)[-1]
  if module.startswith("xla") or module.endswith("xla"):
    return XLA
  if module == "mosaic":
    return MOSAIC_GPU
  if module.startswith("mosaic_tpu") or module == "pallas_tpu":
    return MOSAIC_TPU
  return module
