"""The one dispatch rule: None, one name, a sequence, unknown names, backward fallback."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from suites.core.conftest import F32_VS_F64, assert_matches, references, tolerance
from tokamax._src.autotuning import example_user_op as ex
from tokamax._src.ops import op as op_lib
from tokamax._src.ops import registry
from tokamax._src.ops.attention import spec as attention_spec
from tokamax._src.ops.gated_linear_unit import spec as glu_spec
from tokamax._src.ops.linear_softmax_cross_entropy_loss import spec as loss_spec
from tokamax._src.ops.linear_softmax_cross_entropy_loss import xla as loss_xla
from tokamax._src.ops.normalization import spec as norm_spec
from tokamax._src.ops.normalization import xla as norm_xla


@pytest.mark.parametrize("spec", registry.SPECS.values(), ids=registry.SPECS.keys())
def test_xla_is_always_last_candidate(spec):
  for platform in ("cpu", "gpu", "tpu"):
    assert spec.default_order(platform)[-1] == "xla"
  assert spec.get("xla").supported_on(jax.devices("cpu")[0])


def test_unknown_name_lists_valid_names(inputs):
  x = inputs.normal((2, 8))
  with pytest.raises(ValueError, match=r"unknown implementation 'nope'.*'xla'.*'triton'"):
    tokamax.layer_norm(x, None, None, implementation="nope")
  with pytest.raises(ValueError, match="unknown implementation"):
    tokamax.layer_norm(x, None, None, implementation=("xla", "nope"))


def test_named_unsupported_raises_with_reason(inputs):
  q = inputs.normal((1, 8, 2, 16))
  # float32 query: off a GPU cuDNN is out for the platform, on one for the dtype.
  why = "float32" if jax.default_backend() == "gpu" else "gpu"
  with pytest.raises(NotImplementedError, match=rf"cudnn: .*{why}"):
    tokamax.dot_product_attention(q, q, q, implementation="cudnn")


def test_sequence_tries_in_order_and_lists_every_reason(inputs):
  q = inputs.normal((1, 8, 2, 16))
  out = tokamax.dot_product_attention(q, q, q, implementation=("cudnn", "xla_chunked"))
  assert_matches(out, references.high_precision(references.attention)(q, q, q))
  with pytest.raises(NotImplementedError) as info:
    tokamax.dot_product_attention(q, q, q, implementation=("cudnn", "mosaic"))
  assert "cudnn:" in str(info.value) and "mosaic:" in str(info.value)


def test_empty_sequence_is_rejected(inputs):
  with pytest.raises(ValueError, match="non-empty"):
    tokamax.layer_norm(inputs.normal((2, 4)), None, None, implementation=())


@dataclasses.dataclass(frozen=True, kw_only=True)
class _ForwardOnlyNorm(norm_xla.XlaLayerNorm):
  """A kernel-like implementation: not differentiable by JAX, backward only for RMSNorm."""

  name = "forward_only"
  differentiable = False
  calls: list = dataclasses.field(default_factory=list, compare=False, hash=False)

  def _bwd(self, args, config, out, residuals, dout):
    self.calls.append("own_bwd")
    _, vjp = jax.vjp(
      lambda x, s, o: norm_spec.reference(dataclasses.replace(args, x=x, scale=s, offset=o)),
      args.x,
      args.scale,
      args.offset,
    )
    dx, ds, do = vjp(dout)
    return {"x": dx, "scale": ds, "offset": do}

  def _bwd_unsupported_reason(self, args):
    return None if not args.subtract_mean else "only RMSNorm"


@dataclasses.dataclass(frozen=True, kw_only=True)
class _WideCotangentNorm(_ForwardOnlyNorm):
  """A backward pass that returns x's cotangent in float32 (or with a row dropped)."""

  name = "wide_cotangent"
  drop_row: bool = False

  def _bwd(self, args, config, out, residuals, dout):
    grads = super()._bwd(args, config, out, residuals, dout)
    dx = grads["x"].astype(jnp.float32)
    return grads | {"x": dx[1:] if self.drop_row else dx}


@pytest.mark.parametrize("drop_row", (False, True), ids=("dtype", "shape"))
def test_a_cotangent_unlike_its_input_is_an_error(drop_row, inputs):
  """JAX's custom_vjp lets a float32 cotangent of a bfloat16 input through: the op refuses
  it, naming the implementation, rather than hand users gradients in another dtype."""
  impl = _WideCotangentNorm(drop_row=drop_row)
  x = inputs.normal((4, 16)).astype(jnp.bfloat16)
  loss = lambda x: tokamax.layer_norm(x, None, None, subtract_mean=False, implementation=impl)
  with pytest.raises(TypeError, match=r"layer_norm\[wide_cotangent\].*float32.*bfloat16"):
    jax.grad(lambda x: loss(x).astype(jnp.float32).sum())(x)


@pytest.mark.parametrize("subtract_mean", (False, True), ids=("own_backward", "xla_fallback"))
def test_gradient_falls_back_when_backward_unsupported(subtract_mean, inputs):
  impl = _ForwardOnlyNorm()
  x, scale, offset = inputs.normal((4, 16)), inputs.normal((16,)), inputs.normal((16,))
  loss = lambda x, s: tokamax.layer_norm(
    x, s, offset, subtract_mean=subtract_mean, implementation=impl
  ).sum()
  grads = jax.grad(loss, argnums=(0, 1))(x, scale)
  ref = lambda x, s: references.layer_norm(x, s, offset, subtract_mean=subtract_mean).sum()
  _, ref_grads = references.high_precision_vjp(ref, (x, scale), np.float32(1.0))
  assert_matches(grads[0], ref_grads[0])
  assert_matches(grads[1], ref_grads[1])
  assert impl.calls == ([] if subtract_mean else ["own_bwd"])


def test_callable_in_sequence_is_tried(inputs):
  x = inputs.normal((3, 8))

  def refuses(*args, **kwargs):
    raise NotImplementedError("never")

  out = tokamax.layer_norm(x, None, None, implementation=(refuses, "xla"))
  assert_matches(out, references.high_precision(references.layer_norm)(x, None, None))


def test_callable_that_fails_otherwise_is_not_skipped(inputs):
  """Only NotImplementedError moves on to the next candidate: a callable's other errors are
  the caller's to see, not a reason to fall back silently."""
  x = inputs.normal((3, 8))

  def broken(*args, **kwargs):
    raise ValueError("broken kernel")

  with pytest.raises(ValueError, match="broken kernel"):
    tokamax.layer_norm(x, None, None, implementation=(broken, "xla"))


def test_no_support_error_names_a_refusing_callable(inputs):
  """A callable's NotImplementedError is listed under the callable's name."""
  x = inputs.normal((3, 8))

  def my_refusing_kernel(*args, **kwargs):
    raise NotImplementedError("too wide")

  with pytest.raises(NotImplementedError, match=r"'my_refusing_kernel': too wide"):
    tokamax.layer_norm(x, None, None, implementation=(my_refusing_kernel,))


def test_op_call_and_bound_arguments(inputs):
  from tokamax._src.ops.attention import xla_chunked

  impl = xla_chunked.XlaChunkedAttention()
  q = inputs.normal((1, 40, 2, 8))
  bound = impl.bind(q, q, q, is_causal=True)
  assert bound.heuristics_config == xla_chunked.ChunkedConfig(kv_chunk_size=40)
  assert xla_chunked.ChunkedConfig(kv_chunk_size=40) in bound.autotuning_configs
  assert isinstance(impl, tokamax.Op) and isinstance(bound, tokamax.BoundArguments)
  assert_matches(
    impl(q, q, q, is_causal=True),
    references.high_precision(references.attention)(q, q, q, is_causal=True),
  )
  assert "mosaic" in tokamax.DotProductAttentionImplementation.__args__


def test_bound_arguments_name_every_canonical_argument(inputs):
  """`BoundArguments.arguments`: the canonical record by field name, the first array included."""
  x, scale = inputs.normal((3, 8)), inputs.normal((8,))
  bound = norm_xla.XlaLayerNorm().bind(x, scale, None, epsilon=1e-3)
  args = bound.arguments
  assert set(args) == {"x", "scale", "offset", "axis", "epsilon", "scale_offset", "subtract_mean"}
  assert args["x"] is x and args["scale"] is scale and args["offset"] is None
  assert (args["axis"], args["epsilon"], args["subtract_mean"]) == (1, 1e-3, True)


def test_public_names_exist():
  for name in (
    "dot_product_attention",
    "layer_norm",
    "gated_linear_unit",
    "ragged_dot",
    "ragged_dot_general",
    "generate_ragged_dot_group_sizes",
    "RaggedDotGroupSizes",
    "linear_softmax_cross_entropy_loss",
    "Op",
    "BoundArguments",
    "DotProductAttentionImplementation",
    "__version__",
    "config",
    "autotuning",
    "benchmarking",
    "autotune",
    "AutotuningResult",
    "standardize_function",
    "benchmark",
    "BenchmarkData",
    "DISABLE_JAX_EXPORT_CHECKS",
  ):
    assert hasattr(tokamax, name), name


@pytest.mark.parametrize("what", ["bias", "mask"])
def test_cudnn_names_a_bias_or_mask_broadcast_over_positions(what):
  """jax.nn's cuDNN path rejects [.., 1, S] biases with a ValueError; ours names the reason."""
  q = jax.ShapeDtypeStruct((2, 16, 4, 64), jnp.bfloat16)
  extra = {
    "bias": jax.ShapeDtypeStruct((2, 4, 1, 16), jnp.bfloat16),
    "mask": jax.ShapeDtypeStruct((1, 1, 16, 1), jnp.bool_),
  }[what]
  record = jax.eval_shape(lambda q, x: attention_spec.canonicalize(q, q, q, **{what: x}), q, extra)
  reason = attention_spec.SPEC.get("cudnn")._unsupported_reason(record)
  assert reason is not None and reason.startswith(what) and "broadcast" in reason
  full = jax.ShapeDtypeStruct((2, 4, 16, 16), extra.dtype)
  record = jax.eval_shape(lambda q, x: attention_spec.canonicalize(q, q, q, **{what: x}), q, full)
  assert attention_spec.SPEC.get("cudnn")._unsupported_reason(record) is None


@pytest.mark.parametrize(
  ("h", "hv", "dtype", "kw", "words"),
  [
    (64, 64, jnp.float32, {}, "float32"),
    (64, 128, jnp.bfloat16, {}, "value head dim 128"),
    (36, 36, jnp.bfloat16, {}, "head dim 36"),
    (264, 264, jnp.bfloat16, {}, "head dim 264"),
    (64, 64, jnp.bfloat16, dict(logits_soft_cap=5.0), "logits_soft_cap"),
    (64, 64, jnp.float16, dict(local_window_size=(4, 0)), "local_window_size"),
    (64, 64, jnp.bfloat16, dict(key_value_seq_lengths=(3, 16)), None),
    (64, 64, jnp.bfloat16, dict(query_seq_lengths=(3, 16), is_causal=True), None),
    (256, 256, jnp.bfloat16, dict(is_causal=True), None),
    (72, 72, jnp.float16, {}, None),
  ],
)
def test_cudnn_unsupported_reasons(h, hv, dtype, kw, words):
  """What cuDNN's fused attention does not take is named (and so falls back), not computed."""
  kw = {k: jnp.array(v) if k.endswith("lengths") else v for k, v in kw.items()}
  q = jax.ShapeDtypeStruct((2, 16, 4, h), dtype)
  v = jax.ShapeDtypeStruct((2, 16, 4, hv), dtype)
  record = jax.eval_shape(lambda q, v: attention_spec.canonicalize(q, q, v, **kw), q, v)
  reason = attention_spec.SPEC.get("cudnn")._unsupported_reason(record)
  if words is None:
    assert reason is None
  else:
    assert reason is not None and words in reason, reason


def test_attention_with_a_bias_or_mask_differentiates_through_its_own_order_on_a_gpu(inputs):
  """The forward keeps Mosaic first; under differentiation a bias puts Triton first and a
  mask alone drops cuDNN (not deterministic)."""
  q = inputs.normal((1, 8, 2, 16))
  bias = inputs.normal((1, 2, 8, 8))
  mask = jnp.tril(jnp.ones((8, 8), bool))[None, None]
  plain = attention_spec.canonicalize(q, q, q)
  biased = attention_spec.canonicalize(q, q, q, bias=bias)
  masked = attention_spec.canonicalize(q, q, q, mask=mask)
  both = attention_spec.canonicalize(q, q, q, bias=bias, mask=mask)
  spec = attention_spec.SPEC
  for record in (plain, biased, masked, both):
    assert spec.default_order("gpu", record) == ("mosaic", "cudnn", "triton", "xla")
  assert spec.default_order("tpu", biased) == ("mosaic_tpu", "xla")
  preference = attention_spec.gradient_preference
  assert preference(biased, "gpu") == ("triton", "mosaic", "cudnn", "xla")
  assert preference(both, "gpu") == ("triton", "mosaic", "cudnn", "xla")
  assert preference(masked, "gpu") == ("mosaic", "triton", "xla")
  for record, platform in ((plain, "gpu"), (biased, "tpu"), (masked, "tpu")):
    assert preference(record, platform) == ()


def test_gated_linear_unit_with_few_rows_tries_triton_first_on_a_gpu(inputs):
  """Triton's forward for decode-sized calls; Mosaic's forward and backward under
  differentiation."""
  w = jax.ShapeDtypeStruct((64, 2, 32), jnp.bfloat16)
  record = lambda m: jax.eval_shape(
    lambda x, w: glu_spec.canonicalize(x, w), jax.ShapeDtypeStruct((m, 64), jnp.bfloat16), w
  )
  few, many = record(glu_spec.TRITON_FORWARD_ROWS), record(glu_spec.TRITON_FORWARD_ROWS + 1)
  spec = glu_spec.SPEC
  assert spec.default_order("gpu", few) == ("triton", "mosaic", "xla")
  assert spec.default_order("gpu", many) == ("mosaic", "triton", "xla")
  # M128, the decode-sized call whose timings `reorder` cites: Triton's forward first.
  assert spec.default_order("gpu", record(128))[0] == "triton"
  assert glu_spec.gradient_preference(few, "gpu")[0] == "mosaic"
  assert glu_spec.gradient_preference(many, "gpu") == ()
  assert glu_spec.gradient_preference(few, "tpu") == ()


def test_gated_linear_unit_of_an_empty_contraction_dispatches_on_a_gpu():
  """K = 0 (six rows of no elements): the few-rows rule counts M from the shape, not as
  x.size // K (a ZeroDivisionError), and a call lowered for a GPU gives its shapes, value and
  gradients."""
  from tokamax._src import export

  x = jax.ShapeDtypeStruct((2, 3, 0), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((0, 2, 128), jnp.bfloat16)
  record = jax.eval_shape(lambda x, w: glu_spec.canonicalize(x, w), x, w)
  assert glu_spec.SPEC.default_order("gpu", record) == ("triton", "mosaic", "xla")
  assert glu_spec.gradient_preference(record, "gpu")[0] == "mosaic"

  def f(x, w):
    return tokamax.gated_linear_unit(x, w, activation=jax.nn.silu).astype(jnp.float32).sum()

  with export.abstract_gpu():
    out = jax.eval_shape(lambda x, w: tokamax.gated_linear_unit(x, w), x, w)
    dx, dw = jax.eval_shape(jax.grad(f, argnums=(0, 1)), x, w)
  assert (out.shape, out.dtype) == ((2, 3, 128), jnp.bfloat16)
  assert (dx.shape, dw.shape) == (x.shape, w.shape)


def _loss_picking_chunked_forward_and_xla_gradient(inputs):
  """The loss spec with forward pick chunked_xla and gradient pick xla, and its inputs."""
  spec = dataclasses.replace(
    loss_spec.SPEC,
    preference={jax.default_backend(): ("chunked_xla",)},
    gradient_preference=lambda args, platform: ("xla",),
    _cache={},
  )
  x, w = inputs.normal((16, 8)), inputs.normal((8, 40))
  return spec, x, jnp.arange(16, dtype=jnp.int32) % 40, w


def test_none_differentiates_through_the_gradient_preference(inputs):
  """The value alone comes from the forward's pick; under differentiation, forward and
  backward come from `gradient_preference`'s (here chunked_xla, then xla)."""
  spec, x, labels, w = _loss_picking_chunked_forward_and_xla_gradient(inputs)
  run = lambda x, w: spec(x, labels, w, reduction="mean")
  reference = lambda x, w: references.linear_softmax_cross_entropy_loss(
    x, labels, w, reduction="mean"
  )
  token = op_lib.RECORDED_CALLS.set([])
  try:
    value = jax.jit(run)(x, w)
    forward_only = [(op.name, mode) for op, _, mode in op_lib.RECORDED_CALLS.get()]
    op_lib.RECORDED_CALLS.get().clear()
    value_too, grads = jax.jit(jax.value_and_grad(run, argnums=(0, 1)))(x, w)
    differentiated = {(op.name, mode) for op, _, mode in op_lib.RECORDED_CALLS.get()}
  finally:
    op_lib.RECORDED_CALLS.reset(token)
  assert forward_only == [("chunked_xla", "forward")]
  assert differentiated == {("xla", "forward"), ("xla", "vjp")}
  ref_value, ref_grads = references.high_precision_vjp(reference, (x, w), np.float32(1.0))
  assert_matches(value, ref_value)
  assert_matches(value_too, ref_value)
  assert_matches(grads[0], ref_grads[0])
  assert_matches(grads[1], ref_grads[1])


def test_a_named_implementation_differentiates_through_itself(inputs):
  """`gradient_preference` is `implementation=None`'s: a named implementation computes its
  forward and its backward under differentiation."""
  spec, x, labels, w = _loss_picking_chunked_forward_and_xla_gradient(inputs)
  run = lambda x, w: spec(x, labels, w, implementation="chunked_xla")
  token = op_lib.RECORDED_CALLS.set([])
  try:
    jax.jit(jax.value_and_grad(run, argnums=(0, 1)))(x, w)
    differentiated = {(op.name, mode) for op, _, mode in op_lib.RECORDED_CALLS.get()}
  finally:
    op_lib.RECORDED_CALLS.reset(token)
  assert differentiated == {("chunked_xla", "forward"), ("chunked_xla", "vjp")}


def test_loss_differentiates_through_xla_on_a_gpu_while_its_logits_fit():
  def args(b, v):
    x = jax.ShapeDtypeStruct((b, 64), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((64, v), jnp.bfloat16)
    return loss_spec.LossArgs(
      x=x,
      labels=jax.ShapeDtypeStruct((b,), jnp.int32),
      weights=w,
      reduction="sum",
      precision=None,
    )

  limit = 8 * 2**30  # The README's: "while its float32 logits fit 8 GiB".
  fits, too_big = args(8192, 131072), args(limit // (4 * 4096) + 1, 4096)
  assert loss_spec.gradient_preference(fits, "gpu") == ("xla",)
  assert loss_spec.gradient_preference(args(limit // (4 * 4096), 4096), "gpu") == ("xla",)
  assert loss_spec.gradient_preference(too_big, "gpu") == ()
  assert loss_spec.gradient_preference(fits, "tpu") == ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class _NowhereLoss(loss_xla.XlaLoss):
  """A loss implementation for a platform that no test machine has."""

  name = "nowhere"
  platforms = ("no_such_platform",)


def test_a_gradient_preference_that_supports_nothing_differentiates_the_forwards_pick(inputs):
  """No name of `gradient_preference` takes the call: the forward's pick computes the
  forward and its own backward, as without a preference."""
  spec, x, labels, w = _loss_picking_chunked_forward_and_xla_gradient(inputs)
  spec = dataclasses.replace(
    spec,
    implementations={**spec.implementations, "nowhere": f"{__name__}:_NowhereLoss"},
    gradient_preference=lambda args, platform: ("nowhere",),
  )
  assert isinstance(op_lib._supporting(spec, "nowhere", spec.canonicalize(x, labels, w)), str)
  run = lambda x, w: spec(x, labels, w, reduction="mean")
  token = op_lib.RECORDED_CALLS.set([])
  try:
    value, grads = jax.jit(jax.value_and_grad(run, argnums=(0, 1)))(x, w)
    differentiated = {(op.name, mode) for op, _, mode in op_lib.RECORDED_CALLS.get()}
  finally:
    op_lib.RECORDED_CALLS.reset(token)
  assert differentiated == {("chunked_xla", "forward"), ("chunked_xla", "vjp")}
  reference = lambda x, w: references.linear_softmax_cross_entropy_loss(
    x, labels, w, reduction="mean"
  )
  ref_value, ref_grads = references.high_precision_vjp(reference, (x, w), np.float32(1.0))
  assert_matches(value, ref_value)
  assert_matches(grads[0], ref_grads[0])
  assert_matches(grads[1], ref_grads[1])


@dataclasses.dataclass(frozen=True, kw_only=True)
class _NowhereNorm(norm_xla.XlaLayerNorm):
  """An implementation for a platform that no test machine has."""

  name = "nowhere"
  platforms = ("no_such_platform",)


def test_an_implementation_called_directly_checks_its_platform(inputs):
  x = inputs.normal((2, 8))
  impl = _NowhereNorm()
  assert not impl.supported_on()
  with pytest.raises(NotImplementedError, match=r"nowhere\]: runs on no_such_platform, not on"):
    impl(x, None, None)


def test_supported_on_asks_about_the_device_given():
  """`supported_on(device)` answers for that device's platform, not the default backend's."""
  impl = _NowhereNorm()
  elsewhere = types.SimpleNamespace(platform="no_such_platform")
  assert impl.supported_on(elsewhere)
  assert not impl.supported_on(jax.devices("cpu")[0])
  assert not norm_spec.SPEC.get("xla").supported_on(elsewhere)


@pytest.mark.parametrize("batch", ((2, 3), ()), ids=("two_batch_dims", "no_batch_dims"))
def test_an_implementation_called_directly_keeps_the_public_layout(batch, inputs):
  """`Op.__call__` maps the canonical [B, ...] output back to the query's batch dims, and a
  fixed config is the one the call resolves to."""
  from tokamax._src.ops.attention import xla_chunked

  config = xla_chunked.ChunkedConfig(kv_chunk_size=7)
  impl = xla_chunked.XlaChunkedAttention(config=config)
  q = inputs.normal((*batch, 12, 2, 8))
  assert impl.bind(q, q, q).default_config == config
  out = impl(q, q, q, is_causal=True)
  assert out.shape == q.shape
  assert_matches(out, references.high_precision(references.attention)(q, q, q, is_causal=True))


def _row_rms_float64(x):
  x = np.asarray(x, np.float64)
  return np.sqrt(np.mean(x * x, axis=-1))


def test_default_order_tries_xla_once_and_last_even_where_preferred():
  """A `preference` that names "xla" first still leaves it the one last candidate."""
  spec = dataclasses.replace(ex.SPEC, preference={"cpu": ("xla", "blocked")}, _cache={})
  assert spec.default_order("cpu") == ("blocked", "xla")
  assert spec.default_order("tpu") == ("xla",)


def test_move_first_leaves_names_without_it_unchanged():
  assert op_lib.move_first("triton", ("mosaic", "cudnn", "triton")) == (
    "triton",
    "mosaic",
    "cudnn",
  )
  assert op_lib.move_first("triton", ("mosaic", "cudnn")) == ("mosaic", "cudnn")
  assert op_lib.move_first("triton", ()) == ()


def test_dispatch_maps_the_output_back_to_the_public_layout(inputs):
  """By name or by `None`, the canonical [M] rows come back in the input's batch dims."""
  x = inputs.normal((2, 3, 16))
  for implementation in (None, "blocked", ("xla",)):
    out = ex.row_rms(x, implementation=implementation)
    assert out.shape == (2, 3), implementation
    np.testing.assert_allclose(np.asarray(out), _row_rms_float64(x), rtol=1e-5)


def test_a_bare_callable_is_an_implementation(inputs):
  """`implementation` may be one callable, not only a sequence holding one."""
  x = inputs.normal((3, 8))
  seen = []

  def mine(x, scale, offset, **kwargs):
    seen.append((x.shape, kwargs["epsilon"]))
    return references.layer_norm(x, scale, offset, epsilon=kwargs["epsilon"])

  out = tokamax.layer_norm(x, None, None, epsilon=1e-3, implementation=mine)
  assert seen == [((3, 8), 1e-3)]
  assert_matches(out, references.high_precision(references.layer_norm)(x, None, None, epsilon=1e-3))


def test_a_split_gradient_keeps_the_public_layout(inputs):
  """Where `gradient_preference` names another implementation than the forward's pick, the
  value (and its gradient) still come back in the input's batch dims."""
  spec = dataclasses.replace(ex.SPEC, gradient_preference=lambda args, platform: ("xla",))
  x = inputs.normal((2, 3, 16))
  out = spec(x)
  assert out.shape == (2, 3)
  np.testing.assert_allclose(np.asarray(out), _row_rms_float64(x), rtol=1e-5)
  grad = jax.grad(lambda x: spec(x).sum())(x)
  # d rms / dx = x / (N * rms), row by row.
  x64 = np.asarray(x, np.float64)
  expected = x64 / (16 * _row_rms_float64(x)[..., None])
  np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-4, atol=1e-6)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _UnpartitionedForwardOnlyNorm(_ForwardOnlyNorm):
  name = "unpartitioned"
  partitioned = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class _PartitionedXlaNorm(norm_xla.XlaLayerNorm):
  name = "partitioned_xla"
  partitioned = True


def test_apply_partitions_what_jax_cannot_trace_into(monkeypatch, inputs):
  """By default a kernel (`differentiable=False`) runs through its op's partitioning rule and
  what JAX traces into is left to XLA's partitioner but on explicit mesh axes;
  `partitioned` overrides either way."""
  partitioned = []

  def apply(op, args, fn, *, explicit_only):
    partitioned.append((op.name, explicit_only))
    return fn(args)

  monkeypatch.setattr(op_lib.partitioning, "apply", apply)
  x = inputs.normal((4, 8))
  record = norm_spec.SPEC.canonicalize(x, None, None)
  expected = references.high_precision(references.layer_norm)(x, None, None)
  for impl in (
    norm_xla.XlaLayerNorm(),
    _ForwardOnlyNorm(),
    _UnpartitionedForwardOnlyNorm(),
    _PartitionedXlaNorm(),
  ):
    assert_matches(impl.apply(record), expected)
  assert partitioned == [
    ("xla", True),
    ("forward_only", False),
    ("unpartitioned", True),
    ("partitioned_xla", False),
  ]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _InputGradientOnlyNorm(_ForwardOnlyNorm):
  """A backward pass that returns the input's gradient alone."""

  name = "input_gradient_only"

  def _bwd(self, args, config, out, residuals, dout):
    return {"x": super()._bwd(args, config, out, residuals, dout)["x"]}


@pytest.mark.parametrize(
  ("dtype", "tol"),
  [
    (jnp.float32, F32_VS_F64),
    (jnp.bfloat16, tolerance.for_dtype(jnp.bfloat16, gradient=True)),
  ],
  ids=["float32", "bfloat16"],
)
def test_fields_the_backward_leaves_out_get_zero_gradients(inputs, dtype, tol):
  """Scale and offset left out by the backward get zeros of their own dtype."""
  impl = _InputGradientOnlyNorm()
  x, scale, offset = (inputs.normal(s).astype(dtype) for s in ((4, 16), (16,), (16,)))
  run = lambda x, s, o: tokamax.layer_norm(x, s, o, subtract_mean=False, implementation=impl)
  loss = lambda *a: run(*a).astype(jnp.float32).sum()
  dx, dscale, doffset = jax.grad(loss, argnums=(0, 1, 2))(x, scale, offset)
  ref = lambda x: references.layer_norm(x, scale, offset, subtract_mean=False).sum()
  _, (ref_dx,) = references.high_precision_vjp(ref, (x,), np.float32(1.0))
  assert dx.dtype == dtype
  assert_matches(dx, ref_dx, tol=tol)
  for g in (dscale, doffset):
    assert g.dtype == dtype and g.shape == (16,) and not np.asarray(g, np.float32).any()


def test_none_follows_the_reorder_rule_for_the_call(inputs):
  """`reorder` sees each call's record: here it drops the blocked kernel for fewer than 4 rows."""
  spec = dataclasses.replace(
    ex.SPEC, reorder=lambda record, platform, names: () if record.x.shape[0] < 4 else names
  )
  for rows, expected in ((2, "xla"), (8, "blocked")):
    x = inputs.normal((rows, 16))
    token = op_lib.RECORDED_CALLS.set([])
    try:
      out = spec(x)
      ran = [op.name for op, _, _ in op_lib.RECORDED_CALLS.get()]
    finally:
      op_lib.RECORDED_CALLS.reset(token)
    assert ran == [expected], rows
    np.testing.assert_allclose(np.asarray(out), _row_rms_float64(x), rtol=1e-5)
