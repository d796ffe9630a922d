"""jax.export of functions with tokamax ops, DISABLE_JAX_EXPORT_CHECKS (issue 7).

On CPU: XLA paths and Pallas interpret mode round-trip (serialize, deserialize,
call) bitwise; CUDA lowering (for an abstract H200) of Pallas Triton kernels
needs the disabled checks and keeps the kernel custom call. Each kernel
implementation that exists is exported for CUDA where it can be lowered
without a GPU; the GPU check script (ci/gpu/tooling.py) covers the rest.
"""

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import tokamax
from tokamax._src import export
from tokamax._src.ops.attention import spec as attention_spec
from tokamax._src.ops.gated_linear_unit import spec as glu_spec
from tokamax._src.ops.linear_softmax_cross_entropy_loss import spec as loss_spec
from tokamax._src.ops.normalization import spec as norm_spec
from tokamax._src.ops.ragged_dot import spec as ragged_dot_spec


def _normal(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _attention(implementation, grad):
  def f(q, k, v):
    return tokamax.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)

  fn = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2)) if grad else f
  return fn, (_normal(1, (2, 64, 4, 16)), _normal(2, (2, 64, 2, 16)), _normal(3, (2, 64, 2, 16)))


def _layer_norm():
  def f(x, scale, offset):
    return tokamax.layer_norm(x, scale, offset, implementation="xla")

  return f, (_normal(4, (16, 64)), _normal(5, (64,)), _normal(6, (64,)))


def _glu():
  def f(x, w):
    return tokamax.gated_linear_unit(x, w, activation=jax.nn.swish, implementation="xla")

  return f, (_normal(7, (16, 32)), _normal(8, (32, 2, 24)))


def _ragged_dot():
  def f(lhs, rhs, sizes):
    return tokamax.ragged_dot(lhs, rhs, sizes, implementation="xla")

  return f, (_normal(9, (40, 16)), _normal(10, (3, 16, 8)), jnp.array([10, 0, 25], jnp.int32))


def _loss():
  def f(x, w, labels):
    return tokamax.linear_softmax_cross_entropy_loss(x, labels, w, implementation="chunked_xla")

  labels = jax.random.randint(jax.random.key(11), (8,), 0, 300)
  return jax.grad(f, argnums=(0, 1)), (_normal(12, (8, 32)), _normal(13, (32, 300)), labels)


CASES = {
  "attention_xla": lambda: _attention("xla", grad=False),
  "attention_xla_chunked_grad": lambda: _attention("xla_chunked", grad=True),
  "layer_norm_xla": _layer_norm,
  "glu_xla": _glu,
  "ragged_dot_xla": _ragged_dot,
  "loss_chunked_xla_grad": _loss,
}


def _assert_bitwise_equal(actual, expected):
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    assert a.dtype == e.dtype and a.shape == e.shape
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


@pytest.mark.parametrize("case", sorted(CASES))
def test_xla_paths_round_trip_bitwise(case):
  f, args = CASES[case]()
  exported = jax.export.export(jax.jit(f), disabled_checks=tokamax.DISABLE_JAX_EXPORT_CHECKS)(*args)
  restored = jax.export.deserialize(exported.serialize())
  assert restored.platforms == (_export_platform(),)
  _assert_bitwise_equal(restored.call(*args), jax.jit(f)(*args))


def _export_platform() -> str:
  """The platform name jax.export records for this backend (GPUs by their toolkit)."""
  backend = jax.default_backend()
  return {"gpu": "cuda"}.get(backend, backend)


def _scaled_add_kernel(x_ref, y_ref, o_ref):
  o_ref[...] = 2.0 * x_ref[...] + y_ref[...]


def _scaled_add(x, y, **kwargs):
  return pl.pallas_call(
    _scaled_add_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), **kwargs
  )(x, y)


def test_pallas_interpret_mode_round_trips_bitwise():
  x, y = _normal(14, (8, 128)), _normal(15, (8, 128))
  f = jax.jit(lambda x, y: _scaled_add(x, y, interpret=True))
  exported = jax.export.export(f, disabled_checks=tokamax.DISABLE_JAX_EXPORT_CHECKS)(x, y)
  out = jax.export.deserialize(exported.serialize()).call(x, y)
  _assert_bitwise_equal(out, f(x, y))
  np.testing.assert_allclose(
    np.asarray(out), 2.0 * np.asarray(x, np.float64) + np.asarray(y, np.float64), rtol=1e-6
  )


def test_pallas_triton_export_for_cuda_needs_the_disabled_checks():
  from jax.experimental.pallas import triton as pltriton

  x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
  f = jax.jit(lambda x, y: _scaled_add(x, y, compiler_params=pltriton.CompilerParams(num_warps=4)))
  with export.abstract_gpu():
    with pytest.raises(ValueError, match="custom calls whose targets have no compatibility"):
      jax.export.export(f, platforms=("cuda",))(x, x)
    exported = jax.export.export(
      f, platforms=("cuda",), disabled_checks=tokamax.DISABLE_JAX_EXPORT_CHECKS
    )(x, x)
  assert export.kernel_custom_calls(exported) == {"__gpu$xla.gpu.triton"}
  restored = jax.export.deserialize(exported.serialize())
  assert restored.platforms == ("cuda",)
  assert export.kernel_custom_calls(restored) == {"__gpu$xla.gpu.triton"}


def _kernel_example(spec_name: str):
  """Public arguments of a small bfloat16 call, in shapes kernels take."""
  bf16 = jnp.bfloat16
  if spec_name == "dot_product_attention":
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), bf16)
    return (q, q, q), {"is_causal": True}
  if spec_name == "layer_norm":
    return (jax.ShapeDtypeStruct((256, 512), bf16), jax.ShapeDtypeStruct((512,), bf16), None), {}
  if spec_name == "gated_linear_unit":
    x, w = jax.ShapeDtypeStruct((256, 512), bf16), jax.ShapeDtypeStruct((512, 2, 256), bf16)
    return (x, w), {"activation": jax.nn.swish}
  if spec_name == "ragged_dot":
    lhs, rhs = jax.ShapeDtypeStruct((512, 256), bf16), jax.ShapeDtypeStruct((4, 256, 256), bf16)
    return (lhs, rhs, jax.ShapeDtypeStruct((4,), jnp.int32)), {}
  x, w = jax.ShapeDtypeStruct((128, 256), bf16), jax.ShapeDtypeStruct((256, 1024), bf16)
  return (x, jax.ShapeDtypeStruct((128,), jnp.int32), w), {}


SPECS = (attention_spec.SPEC, norm_spec.SPEC, glu_spec.SPEC, ragged_dot_spec.SPEC, loss_spec.SPEC)
KERNELS = [
  (spec, name)
  for spec in SPECS
  for name in spec.implementation_names
  if name not in ("xla", "xla_chunked", "chunked_xla")
]


@pytest.mark.parametrize(("spec", "name"), KERNELS, ids=[f"{s.name}-{n}" for s, n in KERNELS])
def test_cuda_export_of_kernel_implementations(spec, name):
  cls = spec.implementation_class_or_reason(name)
  if isinstance(cls, str):
    pytest.skip(f"{spec.name}[{name}]: {cls}")
  op = spec.get(name)
  args, kwargs = _kernel_example(spec.name)
  record = jax.eval_shape(lambda *arrays: spec.canonicalize(*arrays, **kwargs), *args)
  reason = op._unsupported_reason(record)
  if reason is not None:
    pytest.skip(f"{spec.name}[{name}] does not take the example: {reason}")

  def f(*arrays):
    return spec.finalize(record, op.apply(spec.canonicalize(*arrays, **kwargs)))

  try:
    with export.abstract_gpu():
      exported = jax.export.export(
        jax.jit(f), platforms=("cuda",), disabled_checks=tokamax.DISABLE_JAX_EXPORT_CHECKS
      )(*args)
  except ValueError as e:
    if "custom calls whose targets have no compatibility" in str(e):
      raise  # A kernel custom call missing from DISABLE_JAX_EXPORT_CHECKS.
    pytest.skip(
      f"{spec.name}[{name}] does not lower for CUDA without a GPU: {str(e).splitlines()[0][:200]}"
    )
  except Exception as e:
    first = (str(e).splitlines() or [""])[0][:200]
    pytest.skip(
      f"{spec.name}[{name}] does not lower for CUDA without a GPU: {type(e).__name__}: {first}"
    )
  calls = export.kernel_custom_calls(exported)
  assert calls, f"no kernel custom call in {sorted(export.custom_call_targets(exported))}"
  restored = jax.export.deserialize(exported.serialize())
  assert export.kernel_custom_calls(restored) == calls


def test_custom_call_targets_of_both_stablehlo_forms():
  """The pretty form (`stablehlo.custom_call @target(`) and the generic form (`call_target_name`)."""
  text = (
    "%0 = stablehlo.custom_call @triton_kernel_call(%arg0) : (tensor<8xf32>) -> tensor<8xf32>\n"
    '%1 = "stablehlo.custom_call"(%0) {call_target_name = "tpu_custom_call", '
    'backend_config = ""} : (tensor<8xf32>) -> tensor<8xf32>\n'
    "%2 = stablehlo.custom_call @Sharding(%1) : (tensor<8xf32>) -> tensor<8xf32>\n"
  )
  assert export.custom_call_targets(text) == {"triton_kernel_call", "tpu_custom_call", "Sharding"}
  assert export.kernel_custom_calls(text) == {"triton_kernel_call", "tpu_custom_call"}


def test_every_kernel_custom_call_is_allowed_by_the_disabled_checks():
  """Each custom call that the kernels emit, listed by hand, is one the export checks allow."""
  targets = (
    "triton_kernel_call",
    "__gpu$xla.gpu.triton",
    "mosaic_gpu_v2",
    "mosaic_gpu",
    "tpu_custom_call",
    "__cudnn$fmhaSoftmax",
    "__cudnn$fmhaScaleBiasSoftmax",
    "__cudnn$fmhaSoftmaxBackward",
    "__cudnn$fmhaScaleBiasSoftmaxBackward",
  )
  for target in targets:
    assert jax.export.DisabledSafetyCheck.custom_call(target) in tokamax.DISABLE_JAX_EXPORT_CHECKS
    assert export.kernel_custom_calls(f"stablehlo.custom_call @{target}(%0)") == {target}


def test_every_cudnn_call_that_jax_emits_is_allowed():
  """The fused attention custom calls named in JAX's own cuDNN lowering are all allowed."""
  fused = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
  targets = set(re.findall(r'"(__cudnn\$fmha\w+)"', inspect.getsource(fused)))
  assert len(targets) >= 4, targets
  for target in sorted(targets):
    assert jax.export.DisabledSafetyCheck.custom_call(target) in tokamax.DISABLE_JAX_EXPORT_CHECKS


def test_the_abstract_targets_name_an_h200_and_a_v5e():
  """Default targets: an H200 (132 SMs, CUDA) and a TPU v5e (one core); left on exit."""
  with export.abstract_gpu():
    device = jax.sharding.get_abstract_mesh().abstract_device
    assert (device.platform, device.device_kind, device.num_cores) == ("gpu", "NVIDIA H200", 132)
  with export.abstract_tpu():
    device = jax.sharding.get_abstract_mesh().abstract_device
    assert (device.platform, device.device_kind, device.num_cores) == ("tpu", "TPU v5 lite", 1)
  assert jax.sharding.get_abstract_mesh().empty


def test_the_abstract_targets_take_the_device_named():
  """Another GPU (an H100 PCIe: 114 SMs) or TPU (a v6e with two cores) as the target."""
  with export.abstract_gpu("NVIDIA H100 PCIe", num_cores=114):
    device = jax.sharding.get_abstract_mesh().abstract_device
    assert (device.platform, device.device_kind, device.num_cores) == (
      "gpu",
      "NVIDIA H100 PCIe",
      114,
    )
  with export.abstract_tpu("TPU v6 lite", num_cores=2):
    device = jax.sharding.get_abstract_mesh().abstract_device
    assert (device.platform, device.device_kind, device.num_cores) == ("tpu", "TPU v6 lite", 2)


@pytest.mark.parametrize(
  ("target", "platform"), [(export.abstract_gpu, "cuda"), (export.abstract_tpu, "tpu")]
)
def test_an_export_for_an_abstract_target_runs_on_one_device(target, platform):
  """The abstract target is one device: the export does not ask for a mesh of several."""
  x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
  with target():
    exported = jax.export.export(jax.jit(lambda a: 2.0 * a + 1.0), platforms=(platform,))(x)
  assert exported.platforms == (platform,)
  assert exported.nr_devices == 1
