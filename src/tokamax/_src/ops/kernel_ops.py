"""Base classes of the kernel implementations: what every Triton or Mosaic GPU/TPU op shares."""

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

from tokamax._src import arguments, triton_call
from tokamax._src import device as device_lib
from tokamax._src.ops import op


@dataclasses.dataclass(frozen=True, kw_only=True)
class TritonOp(op.Op):
  """A Triton kernel launched through jax-triton (NVIDIA GPUs, sm_80 and newer)."""

  platforms = ("gpu",)
  differentiable = False

  def unsupported_reason(self, args) -> str | None:
    if triton_call.interpreting() and any(
      getattr(x, "dtype", None) == jnp.bfloat16
      for x in jax.tree.leaves(arguments.array_fields(args))
    ):
      # Its host interpreter returns garbage (1e22) for bfloat16 tiles that compile correctly.
      return "Triton's host interpreter miscomputes bfloat16 (compile for a GPU instead)"
    return super().unsupported_reason(args)

  def _platform_reason(self, platform: str, device: jax.Device | None) -> str | None:
    if triton_call.interpreting():  # Triton's host interpreter: any host, called eagerly.
      return (
        None if platform in ("cpu", "gpu") else f"interpret mode runs on cpu/gpu, not {platform}"
      )
    return triton_call.unavailable_reason(platform)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicGpuOp(op.Op):
  """A Pallas Mosaic GPU kernel (Hopper, sm_90: TMA and wgmma).

  Attributes:
    interpret: Run in the Mosaic GPU interpreter, with race detection; this
      works on the CPU too, for tests.
  """

  platforms = ("gpu",)
  differentiable = False

  interpret: bool = False

  @property
  def interpret_params(self) -> plgpu.InterpretGPUParams | None:
    """What the kernels pass as `interpret=`: the interpreter with race detection, or None."""
    return plgpu.InterpretGPUParams(detect_races=True) if self.interpret else None

  def _platform_reason(self, platform: str, device: jax.Device | None) -> str | None:
    if self.interpret:
      return (
        None if platform in ("cpu", "gpu") else f"interpret mode runs on cpu/gpu, not {platform}"
      )
    if platform != "gpu":
      return f"runs on gpu, not on {platform}"
    cc = device_lib.compute_capability(device)
    if cc is None:
      return "needs an NVIDIA GPU"
    if cc[0] != 9:
      return f"needs a Hopper GPU (sm_90, wgmma), got sm_{cc[0]}{cc[1]}"
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicTpuOp(op.Op):
  """A Pallas Mosaic TPU kernel.

  On a CPU host it lowers for a TPU inside `export.abstract_tpu()` (for
  `jax.export` with `platforms=("tpu",)`), and runs in the TPU interpreter
  with `interpret`.

  Attributes:
    interpret: Run in Pallas's TPU interpreter (any host): True for the
      default `pltpu.InterpretParams()`, or the params to use.
  """

  platforms = ("tpu",)
  differentiable = False

  interpret: bool | pltpu.InterpretParams = False

  @property
  def interpret_params(self) -> pltpu.InterpretParams | None:
    """What the kernels pass as `pallas_call(interpret=...)`."""
    if isinstance(self.interpret, pltpu.InterpretParams):
      return self.interpret
    return pltpu.InterpretParams() if self.interpret else None

  def _platform_reason(self, platform: str, device: jax.Device | None) -> str | None:
    if self.interpret:
      return None
    return None if platform == "tpu" else f"runs on tpu, not on {platform}"
