"""Fixtures of the kernel tests."""

import jax
import pytest


@pytest.fixture
def on_cpu():
  """Runs the test's computations on the host CPU: the TPU interpreter's float32 numbers are
  checked against CPU-exact bounds, which an accelerator's default (TF32) matmuls would miss."""
  with jax.default_device(jax.devices("cpu")[0]):
    yield
