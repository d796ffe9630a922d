"""Fixtures of the kernel tests."""

import jax
import pytest

from tokamax._src import tpu


@pytest.fixture
def on_cpu():
  """Runs the test's computations on the host CPU: the TPU interpreter's float32 numbers are
  checked against CPU-exact bounds, which an accelerator's default (TF32) matmuls would miss."""
  with jax.default_device(jax.devices("cpu")[0]):
    yield


@pytest.fixture
def roofline_calls(monkeypatch):
  """The (flops, HBM bytes, grid steps, itemsize) that TPU cost models hand the chip's
  roofline, in call order (`tpu.chip()` replaced by a recorder that returns 0 s)."""
  calls = []

  class Chip:
    def seconds(self, flops, hbm_bytes, steps, itemsize):
      calls.append((flops, hbm_bytes, steps, itemsize))
      return 0.0

  monkeypatch.setattr(tpu, "chip", Chip)
  return calls
