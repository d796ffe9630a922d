"""TPU chips as the Mosaic TPU kernels' cost models see them.

The kernels target TPU v5e ("TPU v5 lite") and v5p. Without a TPU at hand the
chip is the abstract device of the current abstract mesh (`export.abstract_tpu`),
else v5e. The figures are peak numbers per TensorCore (as in
`pltpu.get_tpu_info_for_chip`), used only to rank block sizes; no TPU timing
stands behind them.
"""

import dataclasses

import jax

from tokamax._src import device as device_lib

# Time the pipeline spends per grid step besides its DMAs and compute (a rough,
# commonly quoted figure; it only penalises tiny blocks).
STEP_OVERHEAD_S = 0.35e-6


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TensorCore of a TPU generation.

  Attributes:
    name: "v5e" or "v5p".
    vmem_bytes: Physical VMEM.
    vmem_limit_bytes: The scoped VMEM that kernels ask Mosaic for and that
      their block sizes must fit in (half of VMEM: room for Mosaic's own
      scratch and the pipeline's spills).
    hbm_bytes_per_s: Peak HBM bandwidth.
    bf16_flops_per_s: Peak bfloat16 matmul rate.
  """

  name: str
  vmem_bytes: int
  vmem_limit_bytes: int
  hbm_bytes_per_s: float
  bf16_flops_per_s: float

  def seconds(self, flops: float, hbm_bytes: float, steps: int, itemsize: int) -> float:
    """Roofline time: the slower of MXU and HBM, plus the per-step overhead.

    float32 inputs (`itemsize` 4) take three bfloat16 passes on the MXU.
    """
    rate = self.bf16_flops_per_s / (3 if itemsize == 4 else 1)
    return max(flops / rate, hbm_bytes / self.hbm_bytes_per_s) + steps * STEP_OVERHEAD_S


_MIB = 1 << 20
V5E = Chip("v5e", 128 * _MIB, 64 * _MIB, 819e9, 197e12)
V5P = Chip("v5p", 64 * _MIB, 32 * _MIB, 1380e9, 230e12)


def target_device_kind() -> str | None:
  """The device kind lowerings target: the abstract mesh's, else a TPU at hand's, else None."""
  abstract = jax.sharding.get_abstract_mesh().abstract_device
  if abstract is not None:
    return abstract.device_kind if abstract.platform == "tpu" else None
  dev = device_lib.default_device()
  return dev.device_kind if dev.platform == "tpu" else None


def chip(device_kind: str | None = None) -> Chip:
  """The chip of `device_kind` (default: the target's); v5p for "TPU v5"/"v5p", else v5e."""
  kind = (device_kind if device_kind is not None else target_device_kind() or "").lower()
  if "v5p" in kind or kind.rstrip() == "tpu v5":
    return V5P
  return V5E
