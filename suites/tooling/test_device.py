"""Facts about the accelerator (`tokamax._src.device`), on fake devices and abstract targets."""

import jax

from tokamax._src import device, export


class _Gpu:
  """A device as JAX describes an NVIDIA GPU: its compute capability as "major.minor"."""

  platform = "gpu"

  def __init__(self, compute_capability, core_count=None):
    self.compute_capability, self.core_count = compute_capability, core_count


def test_compute_capability_of_a_gpu_reads_major_then_minor():
  assert device.compute_capability(_Gpu("8.9")) == (8, 9)
  assert device.compute_capability(_Gpu("12.0")) == (12, 0)
  assert device.is_nvidia_gpu(_Gpu("9.0"))


def test_has_sm_compares_major_and_minor():
  """An sm_86 is an sm_80 but not an sm_89; an sm_90 has sm_90 itself."""
  ampere = _Gpu("8.6")
  assert device.has_sm(8, 0, ampere) and device.has_sm(8, 6, ampere)
  assert not device.has_sm(8, 9, ampere) and not device.has_sm(9, 0, ampere)
  hopper = _Gpu("9.0")
  assert device.has_sm(9, device=hopper) and not device.has_sm(10, device=hopper)


def test_platform_and_sm_count_follow_the_abstract_target():
  """Lowering for a TPU: the platform is the TPU's and a GPU's SM count the default (not the
  TPU's one core); a device passed explicitly is asked itself, whatever the target."""
  with export.abstract_tpu():
    assert device.platform() == "tpu"
    assert device.sm_count() == device.DEFAULT_SM_COUNT
  with export.abstract_gpu(num_cores=114):
    assert device.platform() == "gpu"
    assert device.sm_count() == 114
    assert device.sm_count(_Gpu("8.0", core_count=108)) == 108
  assert device.platform() == jax.default_backend()


def test_shared_memory_limit_of_a_capability_given_as_a_list():
  assert device.shared_memory_per_block([9, 0]) == device.shared_memory_per_block((9, 0)) == 232448


def test_shared_memory_per_block_of_every_documented_gpu():
  """The CUDA programming guide's per-block opt-in limits: A100 and Orin 163 KiB; sm_86,
  sm_89, sm_120 and sm_121 99 KiB; Hopper and the data-centre Blackwells 227 KiB."""
  kib = 1024
  for ccs, limit in (
    (((8, 0), (8, 7)), 163 * kib),
    (((8, 6), (8, 9), (12, 0), (12, 1)), 99 * kib),
    (((9, 0), (10, 0), (10, 3), (11, 0)), 227 * kib),
  ):
    for cc in ccs:
      assert device.shared_memory_per_block(cc) == limit, cc
