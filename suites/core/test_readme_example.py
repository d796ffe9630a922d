"""The README's example runs, with implementation None and "xla", and agrees with the reference."""

import re
from pathlib import Path

import jax
import numpy as np
import pytest

import tokamax
from suites.core.conftest import assert_matches
from tokamax._src import triton_call
from tokamax_harness import references

README = Path(__file__).resolve().parents[2] / "README.md"


def _example() -> str:
  text = README.read_text()
  match = re.search(r"## Example\s+```python\n(.*?)```", text, re.S)
  assert match, "README.md has no '## Example' python block"
  return match.group(1)


@pytest.mark.parametrize("implementation", (None, "xla"))
def test_readme_example_runs(implementation):
  source = _example().replace("IMPLEMENTATION = None", f"IMPLEMENTATION = {implementation!r}")
  namespace: dict = {}
  exec(compile(source, str(README), "exec"), namespace)
  x, q, k, v = (namespace[n] for n in ("x", "q", "k", "v"))
  scale = jax.numpy.ones(x.shape[-1])

  def reference(x, scale, q, k, v):
    h = references.layer_norm(x, scale, None)
    out = references.attention(q, k, v, is_causal=True)
    return (h**3).mean() + (out**2).mean()

  _, expected = references.high_precision_vjp(reference, (x, scale, q, k, v), 1.0)
  for got, want in zip(namespace["grads"], expected[:3], strict=True):
    assert_matches(got, want)


def test_readme_interpreter_example_runs():
  """The README's "Running a kernel in its interpreter" block runs on this host and agrees with XLA."""
  match = re.search(
    r"### Running a kernel in its interpreter\s+```python\n(.*?)```", README.read_text(), re.S
  )
  assert match, "README.md has no 'Running a kernel in its interpreter' python block"
  namespace: dict = {}
  exec(compile(match.group(1), str(README), "exec"), namespace)
  tokamax, x, w = namespace["tokamax"], namespace["x"], namespace["w"]
  y = tokamax.gated_linear_unit(x, w, activation=jax.nn.swish, implementation="xla")
  h = tokamax.layer_norm(
    x.astype(jax.numpy.float32), jax.numpy.ones(128), None, implementation="xla"
  )
  f32 = jax.numpy.float32
  # bfloat16 outputs of two implementations: a few bfloat16 ulps apart.
  np.testing.assert_allclose(namespace["y"].astype(f32), y.astype(f32), rtol=3e-2, atol=3e-2)
  np.testing.assert_allclose(namespace["h"], h, rtol=1e-5, atol=1e-5)


def test_triton_interpreter_refuses_bfloat16_by_name():
  """Triton's host interpreter miscomputes bfloat16: a clear error, never a silent wrong answer."""
  x = jax.numpy.ones((8, 64), jax.numpy.bfloat16)
  with triton_call.interpret(), pytest.raises(NotImplementedError, match="bfloat16"):
    tokamax.layer_norm(x, None, None, implementation="triton")
