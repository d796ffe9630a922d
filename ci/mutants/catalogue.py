"""The mutations: small, realistic bugs, each with the tests that should catch it.

Every mutation replaces `old` (which must occur exactly once in `file`) by
`new` in a throwaway copy of the repository; `selection` is the smallest set
of existing tests that should fail for it (pytest arguments, run from the
copy's root).
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Mutation:
  """One planted bug.

  Attributes:
    id: A short unique name.
    file: The mutated file, relative to the repository root.
    old: The text replaced; must occur exactly once in `file`.
    new: Its replacement.
    selection: pytest arguments selecting the tests that should catch it.
    description: What the bug is.
  """

  id: str
  file: str
  old: str
  new: str
  selection: tuple[str, ...]
  description: str

  @property
  def target(self) -> str:
    return self.id.split(".", 1)[0]


def _matrix(expr: str) -> tuple[str, ...]:
  return ("suites/test_matrix.py", "-k", expr)


_COMPARE = "harness/compare.py"
_TOLERANCE = "harness/tolerance.py"
_GRADS = "harness/grads.py"
_OP = "src/tokamax/_src/ops/op.py"
_RESULT = "src/tokamax/_src/autotuning/result.py"
_ATTENTION = "src/tokamax/_src/ops/attention/"
_PINS = "harness/tests/test_tolerance_pins.py"
_COTANGENTS = "harness/tests/test_nonfinite_and_cotangents.py"
_FALLBACK = "suites/core/test_fallback.py"
_RAGGED = "src/tokamax/_src/ops/ragged_dot/"
_LOSS = "src/tokamax/_src/ops/linear_softmax_cross_entropy_loss/"
_MOSAIC_RAGGED = "suites/kernels/test_mosaic_ragged_dot.py"
_MOSAIC_ATTENTION = "suites/kernels/test_attention_mosaic.py"
_TPU_RAGGED = "suites/kernels/test_tpu_ragged_dot.py"
_TPU_RAGGED_KERNEL = _RAGGED + "mosaic_tpu_kernel.py"
_TPU_ATTENTION = "suites/kernels/test_tpu_attention.py"
_TPU_ATTENTION_KERNEL = _ATTENTION + "mosaic_tpu_kernel.py"
_TPU_ATTENTION_CASE = _TPU_ATTENTION + "::test_interpret_matches_reference_with_gradients"
_TPU_LOSS = "suites/kernels/test_tpu_loss.py"
_TPU_LOSS_KERNEL = _LOSS + "mosaic_tpu_kernel.py"
_KERNEL_SHARDING = "suites/core/test_kernel_sharding.py"
_BAD_INPUT = "suites/core/test_bad_input.py"

MUTATIONS: tuple[Mutation, ...] = (
  # --- The harness itself ------------------------------------------------------
  Mutation(
    "harness.tolerance_row_10x",
    _TOLERANCE,
    '"float32": Tolerance(atol=2e-6, rtol=1e-5)',
    '"float32": Tolerance(atol=2e-5, rtol=1e-4)',
    (_PINS, "-k", "float32"),
    "The float32 row loosened 10x.",
  ),
  Mutation(
    "harness.bfloat16_row_10x",
    _TOLERANCE,
    '"bfloat16": Tolerance(atol=2e-3, rtol=1.6e-2, relative_rule=True)',
    '"bfloat16": Tolerance(atol=2e-2, rtol=1.6e-1, relative_rule=True)',
    (_PINS, "-k", "bfloat16 and bound"),
    "The bfloat16 row loosened 10x.",
  ),
  Mutation(
    "harness.float64_row_10x",
    _TOLERANCE,
    '"float64": Tolerance(atol=1e-13, rtol=1e-12)',
    '"float64": Tolerance(atol=1e-12, rtol=1e-11)',
    (_PINS, "-k", "float64"),
    "The float64 row loosened 10x.",
  ),
  Mutation(
    "harness.float16_rtol_tightened",
    _TOLERANCE,
    '"float16": Tolerance(atol=2.5e-4, rtol=2e-3, relative_rule=True)',
    '"float16": Tolerance(atol=2.5e-4, rtol=2e-4, relative_rule=True)',
    (_PINS, "-k", "float16"),
    "The float16 rtol tightened 10x (tests would fail for the wrong reason).",
  ),
  Mutation(
    "harness.gradient_factor_10x",
    _TOLERANCE,
    "GRADIENT_FACTOR = 2.0",
    "GRADIENT_FACTOR = 20.0",
    (_PINS, "-k", "gradient and absolute"),
    "Gradients compared 10x more loosely.",
  ),
  Mutation(
    "harness.nan_passes",
    _COMPARE,
    "  same = (a == e) | (np.isnan(a) & np.isnan(e))",
    "  same = (a == e) | np.isnan(a) | np.isnan(e)",
    (_COTANGENTS + "::test_nonfinite_on_one_side_fails_by_itself",),
    "A NaN on either side counts as agreeing with anything.",
  ),
  Mutation(
    "harness.finiteness_rule_dropped",
    _COMPARE,
    "  if mismatch.any():",
    "  if False:",
    (_COTANGENTS + "::test_nonfinite_on_one_side_fails_by_itself",),
    "No finiteness rule: a NaN fails only through a tolerance that may be loose.",
  ),
  Mutation(
    "harness.first_cotangent_only",
    _GRADS,
    "  for i, name in enumerate(names):",
    "  for i, name in enumerate(names[:1]):",
    (
      _COTANGENTS + "::test_each_wrong_cotangent_is_caught_and_named",
      _COTANGENTS + "::test_wrong_second_weight_of_a_weight_tuple_is_caught",
    ),
    "The VJP check compares only the first cotangent.",
  ),
  Mutation(
    "harness.fraction_off_by_one",
    _COMPARE,
    "  if num_off > (1.0 - tol.fraction) * size:",
    "  if num_off > (1.0 - tol.fraction) * size + 1:",
    (_PINS, "-k", "fraction and float32"),
    "One more element than the fraction allows may exceed the bound.",
  ),
  Mutation(
    "harness.outlier_factor_doubled",
    _COMPARE,
    "  outliers = err > tol.outlier_factor * bound",
    "  outliers = err > 2 * tol.outlier_factor * bound",
    (_PINS, "-k", "fraction and float32"),
    "Outliers may reach 8x the bound.",
  ),
  Mutation(
    "harness.relative_rule_disabled",
    _COMPARE,
    "  if plain is not None and tol.relative_rule:",
    "  if plain is not None and tol.relative_rule and False:",
    (_PINS, "-k", "relative_rule"),
    "The 16-bit relative rule never applies.",
  ),
  Mutation(
    "harness.sqrt_length_dropped",
    _TOLERANCE,
    "    return self.atol * math.sqrt(max(reduction_length, 1)) + self.rtol * np.abs(expected)",
    "    return self.atol * max(reduction_length, 1) + self.rtol * np.abs(expected)",
    (_PINS, "-k", "absolute and float32"),
    "atol scales with L instead of sqrt(L).",
  ),
  # --- Dispatch ------------------------------------------------------------------
  Mutation(
    "dispatch.fallback_zeros",
    _OP,
    "      return vjp(dout)\n",
    "      return vjp(jax.tree.map(jax.numpy.zeros_like, dout))\n",
    (_FALLBACK, "-k", "layer_norm-plain"),
    "The XLA gradient fallback returns zeros.",
  ),
  Mutation(
    "dispatch.differentiable_ignored",
    _OP,
    "    if self.differentiable and self._bwd_unsupported_reason(args) is not None:",
    "    if self._bwd_unsupported_reason(args) is not None:",
    (_FALLBACK, "-k", "layer_norm-plain"),
    "A forward JAX cannot differentiate is differentiated by JAX (no fallback).",
  ),
  Mutation(
    "dispatch.preference_order",
    _OP,
    '    return (*names, "xla")',
    '    return ("xla", *names)',
    ("suites/core/test_dispatch.py", "-k", "xla_is_always_last"),
    "`implementation=None` tries XLA first.",
  ),
  Mutation(
    "dispatch.attention_bias_gradient_order_ignored",
    _ATTENTION + "spec.py",
    '    return op.move_first("triton", names)',
    "    return names",
    ("suites/core/test_dispatch.py", "-k", "differentiates_through_its_own_order"),
    "`implementation=None` differentiates attention with a bias through Mosaic (XLA's bias gradient).",
  ),
  Mutation(
    "dispatch.attention_mask_gradient_nondeterministic",
    _ATTENTION + "spec.py",
    '  return tuple(n for n in names if n != "cudnn")',
    "  return names",
    ("suites/core/test_dispatch.py", "-k", "differentiates_through_its_own_order"),
    "`implementation=None` may differentiate masked attention through cuDNN's atomics backward.",
  ),
  Mutation(
    "dispatch.glu_few_rows_boundary",
    "src/tokamax/_src/ops/gated_linear_unit/spec.py",
    "args.x.size // args.x.shape[-1] <= TRITON_FORWARD_ROWS",
    "args.x.size // args.x.shape[-1] < TRITON_FORWARD_ROWS",
    ("suites/core/test_dispatch.py", "-k", "few_rows"),
    "gated_linear_unit's Triton-first rule misses calls of exactly TRITON_FORWARD_ROWS rows.",
  ),
  Mutation(
    "dispatch.gradient_preference_ignored",
    _OP,
    "      if gradient:\n",
    "      if not gradient:\n",
    ("suites/core/test_dispatch.py", "-k", "gradient_preference"),
    "`implementation=None` differentiates through the forward's pick, not the gradient's.",
  ),
  Mutation(
    "loss.materialized_logits_limit",
    _LOSS + "spec.py",
    "  logits_bytes = 4 * args.x.shape[0] * args.weights.shape[1]",
    "  logits_bytes = 2 * args.x.shape[0] * args.weights.shape[1]",
    ("suites/core/test_dispatch.py", "-k", "logits_fit"),
    "The loss's logits counted as 2-byte values: XLA chosen where float32 logits exceed the limit.",
  ),
  Mutation(
    "dispatch.unknown_name_unchecked",
    _OP,
    "      if isinstance(c, str):\n        self.implementation_class_or_reason(c)",
    "      if isinstance(c, str):\n        pass",
    ("suites/core/test_dispatch.py", "-k", "unknown_name"),
    "Unknown names in a sequence are not rejected before running.",
  ),
  # --- Tooling -------------------------------------------------------------------
  Mutation(
    "tooling.dumps_drops_errors",
    _RESULT,
    '          "errors": [[load(c), e] for c, e in d.errors],',
    '          "errors": [],',
    ("suites/tooling/test_autotuning.py", "-k", "keeps_failed"),
    "Serialised autotuning results lose their failed candidates.",
  ),
  Mutation(
    "tooling.loads_drops_errors",
    _RESULT,
    '        errors=tuple((dump(c), str(e)) for c, e in d.get("errors", ())),',
    "        errors=(),",
    ("suites/tooling/test_autotuning.py", "-k", "keeps_failed"),
    "Loading an autotuning result drops its failed candidates.",
  ),
  Mutation(
    "tooling.stale_default_entry_wins",
    "src/tokamax/_src/autotuning/cache.py",
    "  return data.heuristic == configs.encode(op._get_heuristics_config(args))",
    "  return True",
    ("suites/tooling/test_autotuning.py", "-k", "default_cache"),
    "A shipped entry tuned under other heuristics still outranks today's heuristics.",
  ),
  Mutation(
    "tooling.default_entry_of_older_config_used",
    "src/tokamax/_src/autotuning/cache.py",
    "    if set(json.loads(data.config)) != fields:",
    "    if not set(json.loads(data.config)) <= fields:",
    ("suites/tooling/test_autotuning.py", "-k", "older_config"),
    "A shipped entry that lacks a field of today's config class is still used.",
  ),
  Mutation(
    "tooling.tuned_heuristic_not_recorded",
    "src/tokamax/_src/autotuning/result.py",
    '        heuristic=dump(d.get("heuristic")),',
    "        heuristic=None,",
    ("suites/tooling/test_autotuning.py", "-k", "default_cache"),
    "Loading a result drops the heuristics' config of its tuning run (no shipped entry is used).",
  ),
  Mutation(
    "tooling.cache_key_ignores_dtype",
    "src/tokamax/_src/arguments.py",
    '      desc = ",".join(f"{np.dtype(x.dtype).name}{list(np.shape(x))}" for x in leaves)',
    '      desc = ",".join(f"{list(np.shape(x))}" for x in leaves)',
    ("suites/tooling/test_autotuning.py", "-k", "signature_keys_tell"),
    "The autotuning cache key ignores dtypes (a float32 config serves bfloat16).",
  ),
  Mutation(
    "tooling.median_of_wrong_samples",
    "src/tokamax/_src/benchmarking.py",
    "    return float(np.median(self.evaluation_times_ms))",
    "    return float(np.mean(self.evaluation_times_ms[1:]))",
    ("suites/tooling/test_benchmarking.py", "-k", "times_the_compiled"),
    "The reported time is the mean of all samples but the first.",
  ),
  Mutation(
    "tooling.warmup_timed",
    "src/tokamax/_src/benchmarking.py",
    "  for _ in range(iterations):\n    start = time.perf_counter()",
    "  for _ in range(iterations - 1):\n    start = time.perf_counter()",
    ("suites/tooling/test_benchmarking.py", "-k", "times_the_compiled"),
    "One timed sample fewer than asked.",
  ),
  # --- XLA paths of the ops ----------------------------------------------------------
  Mutation(
    "attention.causal_off_by_one",
    _ATTENTION + "spec.py",
    "    ok = both(ok, kj <= qi)",
    "    ok = both(ok, kj <= qi + 1)",
    _matrix("test_forward and attention and xla] and causal- and float32"),
    "Causal mask lets each query see one future key.",
  ),
  Mutation(
    "attention.softmax_without_max",
    _ATTENTION + "xla.py",
    "  probs = jnp.exp(logits - row_max) / divisor",
    "  probs = jnp.exp(logits) / divisor",
    _matrix("test_forward and attention and xla] and float32"),
    "Softmax without subtracting the row max (overflows for large logits).",
  ),
  Mutation(
    "attention.empty_rows_nan",
    _ATTENTION + "xla.py",
    "    return row_max, total, jnp.maximum(total, jnp.finfo(logits.dtype).tiny)",
    "    return row_max, total, total",
    _matrix("test_forward and attention and xla] and empty_rows and float32"),
    "Rows with no visible key (a mask array) divide 0 by 0 (NaN instead of zeros).",
  ),
  Mutation(
    "attention.empty_rows_nan_positions",
    _ATTENTION + "xla.py",
    "  return row_max, total, jnp.where(total == 0, 1.0, total)",
    "  return row_max, total, total",
    _matrix("test_forward and attention and xla] and float32"),
    "Rows with no visible key by position (sequence lengths) divide 0 by 0.",
  ),
  Mutation(
    "attention.chunked_empty_rows_nan",
    _ATTENTION + "xla_chunked.py",
    "  out = acc / jnp.where(total == 0, 1.0, total)[..., None]",
    "  out = acc / total[..., None]",
    _matrix("test_forward and attention and xla_chunked and empty_rows and float32"),
    "Chunked attention: rows with no visible key give NaN.",
  ),
  Mutation(
    "attention.window_off_by_one",
    _ATTENTION + "spec.py",
    "    ok = both(ok, (kj >= qi - left) & (kj <= qi + right))",
    "    ok = both(ok, (kj > qi - left) & (kj <= qi + right))",
    _matrix("test_forward and attention and xla] and window and float32"),
    "The local window's left edge excludes its last key.",
  ),
  Mutation(
    "attention.soft_cap_wrong",
    _ATTENTION + "spec.py",
    "    logits = args.soft_cap * jnp.tanh(logits / args.soft_cap)",
    "    logits = args.soft_cap * jnp.tanh(logits)",
    _matrix("test_forward and attention and xla] and soft_cap and float32"),
    "Soft cap without dividing by the cap inside tanh.",
  ),
  Mutation(
    "attention.q_lengths_off_by_one",
    _ATTENTION + "spec.py",
    "    ok = both(ok, qi[None, None] < args.q_seq_lengths[:, None, None, None])",
    "    ok = both(ok, qi[None, None] <= args.q_seq_lengths[:, None, None, None])",
    _matrix("test_forward and attention and xla] and q_lengths and float32"),
    "Query lengths: the first padding row is computed (not zero).",
  ),
  Mutation(
    "attention.chunked_last_partial_chunk",
    _ATTENTION + "xla_chunked.py",
    "    self.count = math.ceil(s / self.size)",
    "    self.count = max(s // self.size, 1)",
    ("suites/core/test_attention.py", "-k", "chunked_any_chunk_size"),
    "Chunked attention drops the last partial key chunk.",
  ),
  Mutation(
    "attention.chunked_dbias_first_chunk_only",
    _ATTENTION + "xla_chunked.py",
    "  return jax.lax.dynamic_update_slice_in_dim(dbias, current + ds, start, 3)",
    "  return jax.lax.dynamic_update_slice_in_dim(dbias, current + ds * (start == 0), start, 3)",
    _matrix("test_vjp and xla_chunked and -bias- and float32"),
    "Chunked attention backward: dbias (the last cotangent) keeps only the first key chunk.",
  ),
  Mutation(
    "attention.chunked_soft_cap_gradient",
    _ATTENTION + "xla_chunked.py",
    "      ds = ds * (1.0 - capped * capped)",
    "      ds = ds * (1.0 - capped)",
    _matrix("test_vjp and xla_chunked and soft_cap and float32"),
    "Chunked attention backward: wrong derivative of the soft cap's tanh.",
  ),
  Mutation(
    "layer_norm.epsilon_dropped",
    "src/tokamax/_src/ops/normalization/spec.py",
    "  return affine(args, xf * jax.lax.rsqrt(var + args.epsilon))",
    "  return affine(args, xf * jax.lax.rsqrt(var))",
    ("suites/core/test_layer_norm.py", "-k", "epsilon and xla"),
    "Epsilon dropped from inside the square root.",
  ),
  Mutation(
    "layer_norm.rms_subtracts_mean",
    "src/tokamax/_src/ops/normalization/spec.py",
    "  if args.subtract_mean:\n    xf = xf - xf.mean(axis=args.axis, keepdims=True)",
    "  if True:\n    xf = xf - xf.mean(axis=args.axis, keepdims=True)",
    _matrix("test_forward and layer_norm and xla] and rms- and float32"),
    "RMSNorm subtracts the mean.",
  ),
  Mutation(
    "layer_norm.offset_gradient",
    "src/tokamax/_src/ops/normalization/spec.py",
    "    y = y + _along_axis(args, args.offset)",
    "    y = y + jax.lax.stop_gradient(_along_axis(args, args.offset))",
    _matrix("test_vjp and layer_norm and xla] and rms- and float32"),
    "RMSNorm's offset gets no gradient (forward unchanged).",
  ),
  Mutation(
    "layer_norm.analytic_backward_mean_term",
    "src/tokamax/_src/ops/normalization/xla.py",
    "  dx = (g - mean_g - normalized * mean_gn) * rstd",
    "  dx = (g - normalized * mean_gn) * rstd",
    _matrix("test_vjp and layer_norm and xla] and plain and float32"),
    "LayerNorm's analytic backward forgets the mean's share of dx.",
  ),
  Mutation(
    "layer_norm.rms_forward_rule_centres",
    "src/tokamax/_src/ops/normalization/xla.py",
    "    if not args.subtract_mean:\n      return spec.reference(args), None\n",
    "",
    (_FALLBACK, "-k", "layer_norm-rms"),
    "The XLA forward rule subtracts the mean for RMSNorm (value under differentiation wrong).",
  ),
  Mutation(
    "grads.value_under_differentiation_unchecked",
    _GRADS,
    '      name="the value under differentiation",\n    )\n  except AssertionError as e:\n'
    "    failures.append(str(e))",
    '      name="the value under differentiation",\n    )\n  except AssertionError as e:\n'
    "    del e",
    ("harness/tests/test_teeth.py", "-k", "wrong_value"),
    "assert_vjp_close ignores the value that comes with the VJP.",
  ),
  Mutation(
    "layer_norm.one_pass_unshifted",
    "src/tokamax/_src/ops/normalization/xla.py",
    "  shift = jax.lax.slice_in_dim(xf, 0, 1, axis=args.axis)",
    "  shift = 0.0 * jax.lax.slice_in_dim(xf, 0, 1, axis=args.axis)",
    ("suites/core/test_layer_norm.py", "-k", "large_mean and xla"),
    "One-pass statistics without the shift: E[x^2] - E[x]^2 cancels where the mean is large.",
  ),
  Mutation(
    "glu.output_in_float32",
    "src/tokamax/_src/ops/gated_linear_unit/spec.py",
    "  return (gate * up).astype(args.x.dtype)",
    "  return (gate * up).astype(jnp.float32)",
    ("suites/core/test_gated_linear_unit.py", "-k", "bfloat16"),
    "The XLA gated linear unit returns float32 for bfloat16 inputs.",
  ),
  Mutation(
    "loss.dx_not_cast",
    "src/tokamax/_src/ops/linear_softmax_cross_entropy_loss/xla.py",
    '      "x": _matmul(args, dlogits, args.weights.T).astype(args.x.dtype),',
    '      "x": _matmul(args, dlogits, args.weights.T),',
    ("suites/core/test_loss.py", "-k", "bfloat16"),
    "The XLA loss's dx keeps the matmul's dtype instead of x's.",
  ),
  Mutation(
    "glu.activation_on_up",
    "src/tokamax/_src/ops/gated_linear_unit/spec.py",
    "    gate, up = (dot(w) for w in args.weights)",
    "    up, gate = (dot(w) for w in args.weights)",
    _matrix("test_forward and gated_linear_unit and xla] and split_weights and float32"),
    "Split weights: the activation is applied to the up projection instead of the gate.",
  ),
  Mutation(
    "glu.fused_halves_swapped",
    "src/tokamax/_src/ops/gated_linear_unit/spec.py",
    "    gate, up = both[..., 0, :], both[..., 1, :]",
    "    gate, up = both[..., 1, :], both[..., 0, :]",
    _matrix("test_forward and gated_linear_unit and xla] and swiglu and float32"),
    "Fused [K, 2, N] weights read with gate and up swapped.",
  ),
  Mutation(
    "loss.xla_backward_label_column",
    _LOSS + "xla.py",
    "    dlogits = chunked_xla.logit_cotangents(args, logits, 0, lse, g)",
    "    dlogits = chunked_xla.logit_cotangents(args, logits, 1, lse, g)",
    _matrix("test_vjp and cross_entropy and xla] and sum- and float32"),
    "XLA loss backward: the one-hot of the label one column off (forward unchanged).",
  ),
  Mutation(
    "attention.logits_layout_einsum",
    _ATTENTION + "spec.py",
    "  logits = row_products(qg, k, args.precision, numerics.accumulation_dtype(q.dtype))",
    '  logits = jnp.einsum("btkgh,bskh->bkgts", qg, k, precision=args.precision,'
    " preferred_element_type=numerics.accumulation_dtype(q.dtype))",
    ("suites/core/test_attention.py", "-k", "keys_minor"),
    "The logits through jnp.einsum again: right values, T-minor layout (1.47x on the H200).",
  ),
  Mutation(
    "attention.xla_lse_without_max",
    _ATTENTION + "xla.py",
    "  lse = jnp.where(total > 0, jnp.log(total) + row_max, -jnp.inf)[..., 0]",
    "  lse = jnp.where(total > 0, jnp.log(total), -jnp.inf)[..., 0]",
    _matrix("test_vjp and dot_product_attention and xla] and float32"),
    "XLA attention: the saved log-sum-exp lacks the row maximum, which only the backward"
    " reads (forward unchanged).",
  ),
  Mutation(
    "glu.cpu_backward_halves_swapped",
    "src/tokamax/_src/ops/gated_linear_unit/spec.py",
    "  halves = [d[..., j, :] for j in range(2)]",
    "  halves = [d[..., 1 - j, :] for j in range(2)]",
    _matrix("test_vjp and gated_linear_unit and xla] and swiglu and float32"),
    "The CPU backward of the fused projection pairs each half's cotangent with the other"
    " half's weights (forward unchanged).",
  ),
  Mutation(
    "ragged_dot.group_offset_ignored",
    "src/tokamax/_src/ops/ragged_dot/spec.py",
    "  if args.group_offset is None:\n    return args.group_sizes, None",
    "  if True:\n    return args.group_sizes, None",
    _matrix("test_forward and ragged_dot and xla] and group_offset and float32"),
    "The group offset is ignored.",
  ),
  Mutation(
    "ragged_dot.contracting_offset_slice",
    "src/tokamax/_src/ops/ragged_dot/xla.py",
    "    out = out[1:-1]",
    "    out = out[:-2]",
    _matrix("ragged_dot and xla] and group_offset and float32"),
    "Ragged-contracting layout with a group offset keeps the wrong groups (the rhs gradient"
    " of the default layout).",
  ),
  Mutation(
    "ragged_dot.last_group_dropped",
    "src/tokamax/_src/ops/ragged_dot/spec.py",
    "  if args.group_offset is None:\n    return args.group_sizes, None",
    "  if args.group_offset is None:\n    return args.group_sizes.at[-1].set(0), None",
    _matrix("test_forward and ragged_dot and xla] and default and float32"),
    "The last group's rows are not computed.",
  ),
  Mutation(
    "loss.mean_wrong_count",
    "src/tokamax/_src/ops/linear_softmax_cross_entropy_loss/spec.py",
    "    return per_row.mean()",
    "    return per_row.sum() / (per_row.shape[0] + 1)",
    _matrix("test_forward and cross_entropy and xla] and mean- and float32"),
    "The mean divides by one row too many.",
  ),
  Mutation(
    "loss.label_off_by_one",
    "src/tokamax/_src/ops/linear_softmax_cross_entropy_loss/spec.py",
    "  picked = jnp.take_along_axis(logits, columns[:, None], axis=-1)[:, 0]",
    "  picked = jnp.take_along_axis(logits, columns[:, None] - 1, axis=-1)[:, 0]",
    _matrix("test_forward and cross_entropy and xla] and sum- and float32"),
    "The label's logit is gathered one column to the left.",
  ),
  Mutation(
    "loss.chunked_mean_gradient",
    "src/tokamax/_src/ops/linear_softmax_cross_entropy_loss/chunked_xla.py",
    "    g = jnp.broadcast_to(dout / b, (b,))",
    "    g = jnp.broadcast_to(dout, (b,))",
    _matrix("test_vjp and chunked_xla and mean- and float32"),
    "Chunked loss backward: the mean's gradient is not divided by the batch.",
  ),
  Mutation(
    "loss.chunked_last_partial_chunk",
    "src/tokamax/_src/ops/linear_softmax_cross_entropy_loss/chunked_xla.py",
    "    self.count = math.ceil(v / self.size)",
    "    self.count = max(v // self.size, 1)",
    _matrix("test_forward and chunked_xla and sum- and float32"),
    "The chunked loss drops the last partial vocabulary chunk.",
  ),
  Mutation(
    "loss.chunked_overlap_counted_twice",
    _LOSS + "chunked_xla.py",
    "      jnp.where(repeated, jnp.zeros((), dlogits.dtype), dlogits),\n",
    "      dlogits,\n",
    _matrix("test_vjp and chunked_xla and sum- and float32"),
    "Chunked loss backward: the columns the last chunk shares with the one before add to dx twice.",
  ),
  Mutation(
    "loss.mosaic_exp_not_exp2",
    _LOSS + "mosaic_kernel.py",
    "    shifted = (logits - lax.broadcast_in_dim(top, logits.shape, [0])) * _LOG2E",
    "    shifted = logits - lax.broadcast_in_dim(top, logits.shape, [0])",
    ("suites/kernels/test_mosaic_loss.py", "-k", "interpret or tile"),
    "Mosaic loss kernel: exp2 of unscaled logits (the log2(e) factor dropped).",
  ),
  Mutation(
    "dispatch.fallback_cotangent_summed_twice",
    _OP,
    "      return vjp(dout)\n",
    "      (g,) = vjp(dout)\n"
    "      return (jax.tree.map(lambda g, v: partitioning.cotangent(g, v, axes), g, vmas),)\n",
    (_KERNEL_SHARDING, "-k", "ragged_dot and mosaic and interpret"),
    "The XLA gradient fallback's cotangents, which JAX already summed over the mesh axes an"
    " input does not vary over, summed again (x the shard count) under shard_map.",
  ),
  Mutation(
    "loss.mosaic_label_tile_offset",
    _LOSS + "mosaic_kernel.py",
    "    hit = cols + ni * bn == lax.broadcast_in_dim(",
    "    hit = cols == lax.broadcast_in_dim(",
    ("suites/kernels/test_mosaic_loss.py", "-k", "interpret or tile"),
    "Mosaic loss kernel: the label's column compared within the tile, not the vocabulary"
    " (every tile picks a logit).",
  ),
  Mutation(
    "loss.tail_label_column",
    _LOSS + "spec.py",
    "  return jnp.clip(args.labels - start, 0, v - start - 1), held",
    "  return jnp.clip(args.labels - start + 1, 0, v - start - 1), held",
    ("suites/kernels/test_mosaic_loss.py", "-k", "interpret"),
    "The label's column one off wherever logits are picked from columns (the XLA forward,"
    " and the Mosaic kernel's tail past its last whole tile).",
  ),
  Mutation(
    "loss.mosaic_tiles_maxed",
    _LOSS + "mosaic.py",
    "jax.nn.logsumexp(lse_tiles[:, :b], axis=0)",
    "lse_tiles[:, :b].max(axis=0)",
    ("suites/kernels/test_mosaic_loss.py", "-k", "interpret"),
    "Mosaic loss: the tiles' log-sum-exps are combined by a max instead of a log-sum-exp.",
  ),
  Mutation(
    "loss.mosaic_tail_one_tile_late",
    _LOSS + "mosaic.py",
    "(args, lse, n_tiles * config.block_n, label_tiles",
    "(args, lse, (n_tiles + 1) * config.block_n, label_tiles",
    ("suites/kernels/test_mosaic_loss.py", "-k", "interpret"),
    "Mosaic loss: the vocabulary columns past the last whole tile are skipped.",
  ),
  # --- Interpreted kernels ---------------------------------------------------------
  Mutation(
    "kernels.triton_norm_one_pass_unshifted",
    "src/tokamax/_src/ops/normalization/triton_layer_norm.py",
    "  if NEEDED:",
    "  if NEEDED and False:",
    ("suites/kernels/test_triton_layer_norm.py", "-k", "interpreted"),
    "The one-pass LayerNorm statistics do not shift rows (E[x^2] - E[x]^2 cancels).",
  ),
  Mutation(
    "kernels.triton_layer_norm_mask",
    "src/tokamax/_src/ops/normalization/triton_layer_norm.py",
    "    mean = tl.sum(x, axis=1) / D\n    xc = tl.where(mask, x - mean[:, None], 0.0)\n",
    "    mean = tl.sum(x, axis=1) / D\n    xc = x - mean[:, None]\n",
    _matrix("test_forward and layer_norm and triton] and plain and float32"),
    "Triton LayerNorm forward: padded columns count in the variance.",
  ),
  Mutation(
    "kernels.triton_layer_norm_doffset_init",
    "src/tokamax/_src/ops/normalization/triton_layer_norm.py",
    "  doffset = tl.zeros((BLOCK_D,), tl.float32)",
    "  doffset = tl.full((BLOCK_D,), 1.0, tl.float32)",
    ("suites/kernels/test_triton_layer_norm.py", "-k", "interpreted"),
    "Triton LayerNorm backward: the doffset accumulator starts at 1.",
  ),
  Mutation(
    "kernels.triton_layer_norm_rms_dx",
    "src/tokamax/_src/ops/normalization/triton_layer_norm.py",
    "    dx = (wdy - xhat * c1[:, None]) * rstd[:, None]",
    "    dx = wdy - xhat * c1[:, None]",
    ("suites/kernels/test_triton_layer_norm.py", "-k", "interpreted"),
    "Triton RMSNorm backward: dx not scaled by rstd.",
  ),
  Mutation(
    "kernels.triton_glu_dup",
    "src/tokamax/_src/ops/gated_linear_unit/triton.py",
    "  dup = dout * activated",
    "  dup = dout",
    ("suites/kernels/test_triton_gated_linear_unit.py", "-k", "interpreted"),
    "Triton GLU backward: the up projection's gradient misses the activated gate.",
  ),
  Mutation(
    "kernels.triton_glu_k_mask",
    "src/tokamax/_src/ops/gated_linear_unit/triton_glu.py",
    "      k_ok = ks + k < K",
    "      k_ok = ks + k <= K",
    ("suites/kernels/test_triton_gated_linear_unit.py", "-k", "interpreted"),
    "Triton GLU: the K mask reads one column past K.",
  ),
  Mutation(
    "kernels.triton_glu_halves",
    "src/tokamax/_src/ops/gated_linear_unit/triton_glu.py",
    "  gate, up = tl.split(",
    "  up, gate = tl.split(",
    _matrix("test_forward and gated_linear_unit and triton] and swiglu and float32"),
    "Triton GLU: the activation is applied to the up half.",
  ),
  Mutation(
    "kernels.triton_ragged_row_mask",
    "src/tokamax/_src/ops/ragged_dot/triton_ragged_dot.py",
    "  row_ok = rows < row1",
    "  row_ok = rows <= row1",
    ("suites/kernels/test_triton_ragged_dot.py", "-k", "interpreted"),
    "Triton ragged dot: a group's block also writes the next group's first row.",
  ),
  Mutation(
    "kernels.triton_attention_causal",
    _ATTENTION + "triton_flash.py",
    "    ok = ok & (cols <= rows)",
    "    ok = ok & (cols < rows)",
    _matrix("test_forward and attention and triton] and causal- and float32"),
    "Triton attention: causal mask hides the diagonal.",
  ),
  Mutation(
    "kernels.triton_attention_scale",
    _ATTENTION + "triton_flash.py",
    "    s2 = qk * (SCALE * LOG2E)",
    "    s2 = qk * SCALE",
    _matrix("test_forward and attention and triton] and plain and float32"),
    "Triton attention: logits not converted to log2 units (exp2 of natural logits).",
  ),
  Mutation(
    "kernels.mosaic_attention_causal",
    _ATTENTION + "mosaic_common.py",
    "    ok = both(ok, k_ids <= q_ids)",
    "    ok = both(ok, k_ids < q_ids)",
    (_MOSAIC_ATTENTION + "::test_interpret_matches_xla[fp16_h128_causal_fwd]",),
    "Mosaic attention: causal mask hides the diagonal.",
  ),
  Mutation(
    "kernels.mosaic_attention_soft_cap",
    _ATTENTION + "mosaic_common.py",
    "  return t * (soft_cap * LOG2E), t",
    "  return t * soft_cap, t",
    (_MOSAIC_ATTENTION + "::test_interpret_matches_xla[causal_window_softcap_cross]",),
    "Mosaic attention: soft-capped logits not in log2 units.",
  ),
  Mutation(
    "kernels.mosaic_attention_kv_lengths",
    _ATTENTION + "mosaic_common.py",
    "    ok = both(ok, k_ids < kv_len)",
    "    ok = both(ok, k_ids <= kv_len)",
    (_MOSAIC_ATTENTION + "::test_interpret_matches_xla[lengths_causal_padded]",),
    "Mosaic attention: each row sees the first padding key.",
  ),
  Mutation(
    "kernels.mosaic_attention_staged_tile_rows",
    _ATTENTION + "mosaic_fwd.py",
    "plane.at[pl.ds(tile_r0 + c * bq, bq)",
    "plane.at[pl.ds(tile_r0, bq)",
    (_MOSAIC_ATTENTION + "::test_interpret_matches_xla[bias_scalar_mask_bcast_n_fwd]",),
    "Mosaic attention forward: both consumers get the first consumer's staged mask rows.",
  ),
  Mutation(
    "kernels.mosaic_glu_activation_on_up",
    "src/tokamax/_src/ops/gated_linear_unit/mosaic_kernel.py",
    "      act = gate if activation is None else activation(gate)",
    "      act = gate if activation is None else activation(up)",
    _matrix("test_forward and gated_linear_unit and mosaic] and swiglu and bfloat16"),
    "Mosaic GLU: the activation is applied to the up projection.",
  ),
  Mutation(
    "kernels.mosaic_ragged_partial_block",
    _RAGGED + "mosaic_fwd.py",
    "(seg_end - aligned_start + block_m - 1) // block_m",
    "(seg_end - aligned_start) // block_m",
    (_MOSAIC_RAGGED, "-k", "work_items_cover_every_row_once"),
    "Mosaic ragged dot: the work list drops each segment's last partial row block.",
  ),
  Mutation(
    "kernels.mosaic_gemm_store_ladder",
    "src/tokamax/_src/ops/mosaic_gemm.py",
    "  p = 1 << (max_rows.bit_length() - 1)",
    "  p = 1 << (max_rows.bit_length() - 2)",
    (_MOSAIC_RAGGED + "::test_interpret_two_cta_clusters[False]",),
    "Mosaic GEMM epilogue: the store ladder starts one power of two low (a full warpgroup's"
    " rows are never stored).",
  ),
  Mutation(
    "kernels.mosaic_ragged_drhs_last_chunk_unmasked",
    _RAGGED + "mosaic_drhs.py",
    "          @pl.when((s == 0) | (s == steps - 1))",
    "          @pl.when(s == 0)",
    (_MOSAIC_RAGGED + "::test_interpret_drhs_chunks_at_group_starts[64]",),
    "Mosaic ragged dot drhs: a group's last row chunk is not masked (the next group's rows"
    " add to its gradient).",
  ),
  Mutation(
    "kernels.mosaic_attention_bwd_dq_scale",
    _ATTENTION + "mosaic_bwd.py",
    "      q_smem.at[wg][...] = (acc * p.scale).astype(dtype)",
    "      q_smem.at[wg][...] = acc.astype(dtype)",
    (_MOSAIC_ATTENTION + "::test_interpret_matches_xla[gqa_plain_h64]",),
    "Mosaic attention backward: dq not multiplied by the logits scale.",
  ),
  Mutation(
    "kernels.mosaic_attention_bwd_scale_on_dv",
    _ATTENTION + "mosaic_bwd.py",
    '(acc[x] * p.scale if x == "dk" else acc[x])',
    '(acc[x] * p.scale if x == "dv" else acc[x])',
    (_MOSAIC_ATTENTION + "::test_interpret_matches_xla[gqa_plain_h64]",),
    "Mosaic attention backward: the logits scale applied to dv instead of dk.",
  ),
  Mutation(
    "kernels.mosaic_attention_bwd_soft_cap_derivative",
    _ATTENTION + "mosaic_bwd.py",
    "  return logits, None if t is None else 1.0 - t * t",
    "  return logits, None if t is None else 1.0 - t",
    (_MOSAIC_ATTENTION + "::test_interpret_matches_xla[causal_window_softcap_cross]",),
    "Mosaic attention backward: wrong derivative of the soft cap's tanh.",
  ),
  Mutation(
    "kernels.mosaic_attention_bwd_causal_full_blocks",
    _ATTENTION + "mosaic_common.py",
    "    full_lo = jnp.maximum(full_lo, _cdiv(c_last, block_q))",
    "    full_lo = jnp.maximum(full_lo, _floor_div(c_last, block_q))",
    (_MOSAIC_ATTENTION + "::test_interpret_matches_xla[lengths_causal_padded]",),
    "Mosaic attention backward (dk/dv): the query block on the causal diagonal runs"
    " unmasked (it sees future keys).",
  ),
  Mutation(
    "kernels.mosaic_tpu_ragged_last_tile_dropped",
    _TPU_RAGGED_KERNEL,
    "counts = jnp.where(nonempty, last_tile - first_tile + 1,",
    "counts = jnp.where(nonempty, last_tile - first_tile,",
    (_TPU_RAGGED, "-k", "work_items or interpret_matches"),
    "Mosaic TPU ragged dot: the work list drops each segment's last row tile.",
  ),
  Mutation(
    "kernels.mosaic_tpu_ragged_acc_kept_across_groups",
    _TPU_RAGGED_KERNEL,
    "  @pl.when(compute & (k == 0))",
    "  @pl.when(compute & (k == 0) & (first_ref[i] == 1))",
    (_TPU_RAGGED + "::test_interpret_matches_reference_with_gradients[default_f32]",),
    "Mosaic TPU ragged dot: the accumulator is zeroed only at a tile's first visit, so a"
    " group sharing the tile adds the previous group's product.",
  ),
  Mutation(
    "kernels.mosaic_tpu_ragged_zero_segment_takes_product",
    _TPU_RAGGED_KERNEL,
    "    product_end = jnp.where(compute, end, start)",
    "    product_end = end",
    (_TPU_RAGGED, "-k", "rows_outside_groups or interpret_matches"),
    "Mosaic TPU ragged dot: rows outside every group (zero segments) get a stale"
    " accumulator instead of zeros.",
  ),
  Mutation(
    "kernels.mosaic_tpu_ragged_drhs_row_mask",
    _TPU_RAGGED_KERNEL,
    "      return jnp.where((rows >= start) & (rows < end), x, jnp.zeros_like(x))",
    "      return jnp.where((rows >= start) & (rows <= end), x, jnp.zeros_like(x))",
    (_TPU_RAGGED, "-k", "interpret_matches and ragged_contracting"),
    "Mosaic TPU ragged dot drhs: a group's gradient also takes the next group's first row.",
  ),
  Mutation(
    "kernels.mosaic_tpu_ragged_drhs_last_group_unstored",
    _TPU_RAGGED_KERNEL,
    "  last = (live & (_changed(group, -1) | ~jnp.roll(live, -1))).astype(jnp.int32)",
    "  last = (live & _changed(group, -1)).astype(jnp.int32)",
    (_TPU_RAGGED, "-k", "interpret_matches and ragged_contracting"),
    "Mosaic TPU ragged dot drhs: the last group is never stored when dead work items follow"
    " it (its gradient is uninitialised memory).",
  ),
  Mutation(
    "kernels.mosaic_tpu_ragged_drhs_partial_tile_unmasked",
    _TPU_RAGGED_KERNEL,
    "  whole = (start <= row0) & (row0 + block_m <= end)",
    "  whole = (start <= row0 + block_m) & (row0 <= end)",
    (_TPU_RAGGED, "-k", "interpret_matches and ragged_contracting"),
    "Mosaic TPU ragged dot drhs: tiles a group covers only in part are used unmasked (the"
    " neighbouring groups' rows add to its gradient).",
  ),
  Mutation(
    "kernels.mosaic_tpu_ragged_drhs_output_untyped",
    _TPU_RAGGED_KERNEL,
    "    out_shape=partitioning.kernel_output((num_groups, k, n), out_dtype, *prefetch, lhs, rhs),",
    "    out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),",
    (_KERNEL_SHARDING, "-k", "ragged_dot and mosaic_tpu"),
    "Mosaic TPU ragged_dot: the rhs gradient's kernel output is a plain ShapeDtypeStruct,"
    " untyped for shard_map, so the gradient fails on sharded arrays (explicit mesh axes).",
  ),
  Mutation(
    "kernels.mosaic_tpu_ragged_physical_vmem",
    _RAGGED + "mosaic_tpu.py",
    "  if need > chip.vmem_limit_bytes:",
    "  if need > chip.vmem_bytes:",
    (_TPU_RAGGED + "::test_vmem_limit_is_the_target_chips",),
    "Mosaic TPU ragged dot: blocks checked against the whole VMEM instead of the scoped"
    " limit the kernel asks Mosaic for.",
  ),
  Mutation(
    "ragged_dot.mosaic_not_the_tpu_kernel_on_tpu",
    _RAGGED + "spec.py",
    '  platform_names={"mosaic": {"tpu": "mosaic_tpu"}},',
    "  platform_names={},",
    (_TPU_RAGGED + "::test_export_for_tpu_v5_has_the_mosaic_tpu_call[default-mosaic]",),
    'implementation="mosaic" keeps naming the Mosaic GPU kernel on a TPU.',
  ),
  Mutation(
    "kernels.mosaic_tpu_loss_sum_not_rescaled",
    _TPU_LOSS_KERNEL,
    "    sum_ref[...] = sum_ref[...] * jnp.exp(previous - top) + tile_sum",
    "    sum_ref[...] = sum_ref[...] + tile_sum",
    (_TPU_LOSS, "-k", "kernel_alone or interpret_matches"),
    "Mosaic TPU loss: the online log-sum-exp keeps the earlier tiles' sum of exponentials"
    " unscaled when a later vocabulary tile raises the row maximum.",
  ),
  Mutation(
    "kernels.mosaic_tpu_loss_acc_kept_across_vocab_tiles",
    _TPU_LOSS_KERNEL,
    "  @pl.when(k == 0)\n  def _():\n    acc_ref[...] = jnp.zeros_like(acc_ref)",
    "  @pl.when((j == 0) & (k == 0))\n  def _():\n    acc_ref[...] = jnp.zeros_like(acc_ref)",
    (_TPU_LOSS, "-k", "kernel_alone or interpret_matches"),
    "Mosaic TPU loss: the accumulator is zeroed only at a row tile's first vocabulary tile, so"
    " each tile's logits add the previous tiles'.",
  ),
  Mutation(
    "kernels.mosaic_tpu_loss_dw_rows_unmasked",
    _TPU_LOSS_KERNEL,
    "  x = jnp.where(valid, x_ref[...], jnp.zeros((), x_ref.dtype))",
    "  x = x_ref[...]",
    (_TPU_LOSS, "-k", "interpret_matches"),
    "Mosaic TPU loss backward (dweights): the undefined rows past B of a partial row tile"
    " are multiplied in.",
  ),
  Mutation(
    "kernels.mosaic_tpu_loss_dx_label_columns",
    _TPU_LOSS_KERNEL,
    "  dl = _dlogits(x_ref[...], w, lse_ref, label_ref, g_ref, j * block_v, precision)",
    "  dl = _dlogits(x_ref[...], w, lse_ref, label_ref, g_ref, 0, precision)",
    (_TPU_LOSS, "-k", "interpret_matches"),
    "Mosaic TPU loss backward (dx): every vocabulary tile numbers its columns from 0, so the"
    " label's -1 lands in the wrong tiles.",
  ),
  Mutation(
    "loss.mosaic_tpu_bwd_tail_dx_dropped",
    _LOSS + "mosaic_tpu.py",
    "    dx += jnp.matmul(dlogits, tail.T,",
    "    dx += 0 * jnp.matmul(dlogits, tail.T,",
    (_TPU_LOSS, "-k", "interpret_matches"),
    "Mosaic TPU loss backward: dx misses the vocabulary columns past the last whole tile.",
  ),
  Mutation(
    "loss.mosaic_tpu_tail_one_tile_late",
    _LOSS + "mosaic_tpu.py",
    "with_tail_columns(args, lse, n_tiles * config.block_v)",
    "with_tail_columns(args, lse, (n_tiles + 1) * config.block_v)",
    (_TPU_LOSS, "-k", "interpret_matches"),
    "Mosaic TPU loss: the vocabulary columns past the last whole tile are skipped.",
  ),
  Mutation(
    "loss.mosaic_tpu_physical_vmem",
    _LOSS + "mosaic_tpu.py",
    "  if need > chip.vmem_limit_bytes:",
    "  if need > chip.vmem_bytes:",
    (_TPU_LOSS + "::test_vmem_limit_is_the_target_chips",),
    "Mosaic TPU loss: blocks checked against the whole VMEM instead of the scoped limit the"
    " kernel asks Mosaic for.",
  ),
  Mutation(
    "loss.mosaic_tpu_not_preferred_on_tpu",
    _LOSS + "spec.py",
    '  preference={"gpu": ("mosaic",), "tpu": ("mosaic_tpu",)},',
    '  preference={"gpu": ("mosaic",)},',
    (_TPU_LOSS, "-k", "export_for_tpu_v5_has"),
    "implementation=None runs XLA on a TPU instead of the Mosaic TPU loss kernel.",
  ),
  Mutation(
    "loss.vocabulary_shards_add_log_sum_exps",
    _LOSS + "spec.py",
    "  lse = top + jnp.log(jax.lax.psum(jnp.exp(lse - top), shard.axes))",
    "  lse = jax.lax.psum(lse, shard.axes)",
    (_KERNEL_SHARDING, "-k", "vocabulary"),
    "Loss on vocabulary-sharded weights: the shards' log-sum-exps are added instead of"
    " combined by a log-sum-exp.",
  ),
  Mutation(
    "loss.vocabulary_shard_labels_misplaced",
    _LOSS + "spec.py",
    '  first = shards["v"].index() * args.weights.shape[1]',
    '  first = shards["v"].index()',
    (_KERNEL_SHARDING, "-k", "vocabulary"),
    "Loss on vocabulary-sharded weights: a shard's labels are not counted from its first"
    " column, so the label logits (and their -1 in the backward) land in the wrong shard.",
  ),
  Mutation(
    "loss.vocabulary_foreign_labels_held",
    _LOSS + "spec.py",
    "  held = (args.labels >= start) & (args.labels < v)",
    "  held = args.labels >= start",
    (_KERNEL_SHARDING, "-k", "vocabulary"),
    "Loss on vocabulary-sharded weights: a label past the shard's columns takes its last"
    " column's logit instead of none.",
  ),
  Mutation(
    "kernels.mosaic_tpu_attention_window_skips_visible_block",
    _TPU_ATTENTION_KERNEL,
    "    key_lo = xp.maximum(key_lo, row_lo - left)",
    "    key_lo = xp.maximum(key_lo, row_hi - left)",
    (_TPU_ATTENTION, "-k", "block_ranges"),
    "Mosaic TPU attention: a query block's first key block under a local window is taken"
    " from its last row, so the forward and dq kernels skip keys its earlier rows see.",
  ),
  Mutation(
    "kernels.mosaic_tpu_attention_dkv_causal_range",
    _TPU_ATTENTION_KERNEL,
    "    row_lo = xp.maximum(row_lo, key_lo)",
    "    row_lo = xp.maximum(row_lo, key_hi)",
    (_TPU_ATTENTION_CASE + "[gqa_causal_f32]",),
    "Mosaic TPU attention dk/dv: under a causal mask a key block's first query block is"
    " taken from its last key, so it skips query rows that see its earlier keys.",
  ),
  Mutation(
    "kernels.mosaic_tpu_attention_no_rescale",
    _TPU_ATTENTION_KERNEL,
    "    acc_sc[...] = alpha * acc_sc[...] + _dot(",
    "    acc_sc[...] = acc_sc[...] + _dot(",
    (_TPU_ATTENTION_CASE + "[gqa_causal_f32]",),
    "Mosaic TPU attention forward: the output accumulator is not rescaled when the running"
    " max grows (online softmax).",
  ),
  Mutation(
    "kernels.mosaic_tpu_attention_gqa_head",
    _TPU_ATTENTION_KERNEL,
    "    return bb, nn // g, kv_block(bb, i, j, *prefetch), 0",
    "    return bb, nn % kh, kv_block(bb, i, j, *prefetch), 0",
    (_TPU_ATTENTION_CASE + "[gqa_causal_f32]",),
    "Mosaic TPU attention forward: query head n reads key/value head n % K instead of n // G.",
  ),
  Mutation(
    "kernels.mosaic_tpu_attention_dkv_one_group_head",
    _TPU_ATTENTION_KERNEL,
    "  @pl.when((g == 0) & (i == 0))",
    "  @pl.when(i == 0)",
    (_TPU_ATTENTION_CASE + "[gqa_causal_f32]",),
    "Mosaic TPU attention dk/dv: the accumulators restart for each query head of a group"
    " (GQA gradients keep only the last head's).",
  ),
  Mutation(
    "kernels.mosaic_tpu_attention_soft_cap_grad",
    _TPU_ATTENTION_KERNEL,
    "    ds = ds * (1.0 - capped * capped)",
    "    ds = ds * (1.0 - capped)",
    (_TPU_ATTENTION_CASE + "[window_softcap_bf16_h128]",),
    "Mosaic TPU attention backward: the soft cap's derivative 1 - tanh^2 taken as 1 - tanh.",
  ),
  Mutation(
    "kernels.mosaic_tpu_attention_bwd_ignores_mask",
    _TPU_ATTENTION_KERNEL,
    "  _visit((i >= first) & (i <= last), i, j, q_len, kv_len, p, mask_ref, accumulate)",
    "  _visit((i >= first) & (i <= last), i, j, q_len, kv_len, p, None, accumulate)",
    (_TPU_ATTENTION_CASE + "[bias_mask_full_causal_f32]",),
    "Mosaic TPU attention dk/dv: the boolean mask is left out when the probabilities are"
    " recomputed (the keys it hides get gradients).",
  ),
  Mutation(
    "kernels.mosaic_tpu_attention_diagonal_block_unmasked",
    _TPU_ATTENTION_KERNEL,
    "    whole &= key_hi <= row_lo",
    "    whole &= key_lo <= row_lo",
    (_TPU_ATTENTION_CASE + "[gqa_causal_f32]",),
    "Mosaic TPU attention: blocks on the causal diagonal count as whole and skip the"
    " masking (rows see later keys).",
  ),
  Mutation(
    "kernels.mosaic_tpu_attention_physical_vmem",
    _ATTENTION + "mosaic_tpu.py",
    "  if need > chip.vmem_limit_bytes:",
    "  if need > chip.vmem_bytes:",
    (_TPU_ATTENTION + "::test_vmem_limit_is_the_target_chips",),
    "Mosaic TPU attention: blocks checked against the whole VMEM instead of the scoped"
    " limit the kernels ask Mosaic for.",
  ),
  Mutation(
    "dot_product_attention.mosaic_not_the_tpu_kernel_on_tpu",
    _ATTENTION + "spec.py",
    '  platform_names={"mosaic": {"tpu": "mosaic_tpu"}},',
    "  platform_names={},",
    (_TPU_ATTENTION, "-k", "export_for_tpu_v5_has and features0-mosaic]"),
    'implementation="mosaic" keeps naming the Mosaic GPU kernel on a TPU.',
  ),
  Mutation(
    "ragged_dot.rhs_transposed_drhs_operands",
    _RAGGED + "spec.py",
    '"rhs": (RAGGED_CONTRACTING, "dout", "lhs")',
    '"rhs": (RAGGED_CONTRACTING, "lhs", "dout")',
    _matrix("test_vjp and ragged_dot and xla] and rhs_transposed and g5_k48 and float32"),
    "Transposed-rhs layout: the rhs gradient's operands swapped ([G,K,N] for [G,N,K]); the"
    " matrix's shapes have K != N, so JAX's custom_vjp type check is what fails (a square"
    " rhs_transposed VJP case would be silent).",
  ),
  Mutation(
    "ragged_dot.offset_padding_not_zero",
    _RAGGED + "xla.py",
    "      rhs = jnp.concatenate([zero, rhs, zero])",
    "      rhs = jnp.concatenate([rhs[:1], rhs, rhs[-1:]])",
    _matrix("test_forward and ragged_dot and xla] and group_offset and g3_k32 and float32"),
    "With a group offset, the rows outside the local groups are multiplied by the first and"
    " last local matrices instead of zeros.",
  ),
  Mutation(
    "layer_norm.triton_epsilon_outside_sqrt",
    "src/tokamax/_src/ops/normalization/triton_layer_norm.py",
    "  rstd = 1.0 / tl.sqrt(var + EPS)\n  y = (x - mean[:, None]) * rstd[:, None]\n",
    "  rstd = 1.0 / (tl.sqrt(var) + EPS)\n  y = (x - mean[:, None]) * rstd[:, None]\n",
    _matrix("test_forward and layer_norm and triton] and large_epsilon and float32"),
    "Triton LayerNorm forward: epsilon added outside the square root (visible only for a"
    " large epsilon).",
  ),
  Mutation(
    "attention.query_blocks_miss_their_diagonal",
    _ATTENTION + "xla.py",
    "      s1 = min(s1, t1)\n",
    "      s1 = min(s1, t1 - 1)\n",
    ("suites/core/test_attention.py", "-k", "query_blocks"),
    "XLA attention's causal query blocks stop one key short: each block's last row misses"
    " its own key.",
  ),
  Mutation(
    "attention.query_blocks_never",
    _ATTENTION + "xla.py",
    "  if not (args.is_causal or args.local_window) or t < 2 * QUERY_BLOCK_ROWS:",
    "  if True:",
    ("suites/core/test_attention.py", "-k", "cover_the_visible_keys"),
    "XLA attention computes every key for every query again: right values, 1.45x the causal"
    " forward's time on the H200.",
  ),
  Mutation(
    "attention.query_blocks_window_left_edge",
    _ATTENTION + "xla.py",
    "      s0, s1 = max(s0, t0 - left), min(s1, t1 + right)",
    "      s0, s1 = max(s0, t0 - left + 1), min(s1, t1 + right)",
    ("suites/core/test_attention.py", "-k", "query_blocks"),
    "Windowed query blocks start one key late: each block's first row misses its leftmost key.",
  ),
  Mutation(
    "numerics.one_pass_sum_not_rescaled",
    "src/tokamax/_src/numerics.py",
    "    return jnp.maximum(m_a, m_b), jnp.where(m_a >= m_b, s_a + s_b * weight, s_a * weight + s_b)",
    "    return jnp.maximum(m_a, m_b), jnp.where(m_a >= m_b, s_a + s_b, s_a * weight + s_b)",
    ("suites/core/test_loss.py", "-k", "one_pass or row_max"),
    "The GPU's one-pass log-sum-exp adds a smaller max's sum without rescaling it.",
  ),
  Mutation(
    "numerics.one_pass_nan_for_empty_rows",
    "src/tokamax/_src/numerics.py",
    "    weight = jnp.where(m_a == m_b, 1.0, jnp.exp(-jnp.abs(m_a - m_b))).astype(s_a.dtype)",
    "    weight = jnp.exp(-jnp.abs(m_a - m_b)).astype(s_a.dtype)",
    ("suites/core/test_loss.py", "-k", "row_max"),
    "The one-pass reduction combines two -inf maxes into nan (a row that sees nothing).",
  ),
  Mutation(
    "bench.rounds_in_one_order",
    "bench/run.py",
    "  return list(contenders_[::-1] if r % 2 else contenders_)",
    "  return list(contenders_)",
    ("suites/history/test_bench_run.py", "-k", "alternate"),
    "bench.run times every round in the same order (a contender always after the same one).",
  ),
  Mutation(
    "bench.nondeterministic_rival",
    "bench/run.py",
    "  rivals = {n: ms for n, ms in named.items() if n not in nondeterministic}",
    "  rivals = dict(named)",
    ("suites/history/test_bench_run.py", "-k", "fastest"),
    "bench.run holds None's training step to cuDNN, whose nondeterministic backward None never picks.",
  ),
  # --- Argument checks, output dtypes, benchmarking and the comparators --------------
  Mutation(
    "attention.key_batch_dims_unchecked",
    _ATTENTION + "spec.py",
    "    if tuple(x.shape[:-3]) != batch_shape:",
    "    if len(x.shape[:-3]) != len(batch_shape):",
    (_BAD_INPUT, "-k", "key_batch_dims"),
    "Keys or values whose batch dims differ from the query's (same count) are not rejected.",
  ),
  Mutation(
    "attention.value_heads_unchecked",
    _ATTENTION + "spec.py",
    "  if v.shape[-3:-1] != (s, kh):",
    "  if v.shape[-3] != s:",
    (_BAD_INPUT, "-k", "value_heads"),
    "Values with another head count than the keys are not rejected.",
  ),
  Mutation(
    "attention.mask_shape_unchecked",
    _ATTENTION + "spec.py",
    '    validation.broadcastable("mask", mask.shape, target, LAYOUT)',
    "    pass",
    (_BAD_INPUT, "-k", "mask_shape"),
    "A mask that does not broadcast to [*B, N, T, S] is not rejected by name.",
  ),
  Mutation(
    "attention.lengths_shape_unchecked",
    _ATTENTION + "spec.py",
    '      validation.broadcastable(name, x.shape, batch_shape, "[*#B]")',
    "      pass",
    (_BAD_INPUT, "-k", "lengths_shape"),
    "Sequence lengths that do not broadcast to the batch dims are not rejected by name.",
  ),
  Mutation(
    "attention.zero_soft_cap_accepted",
    _ATTENTION + "spec.py",
    "  if logits_soft_cap is not None and not logits_soft_cap > 0:",
    "  if logits_soft_cap is not None and logits_soft_cap < 0:",
    (_BAD_INPUT, "-k", "soft_cap"),
    "logits_soft_cap=0 is accepted (the logits become 0 * tanh(x / 0): NaN).",
  ),
  Mutation(
    "attention.bias_batch_dims_padded_right",
    _ATTENTION + "spec.py",
    "  lead = (1,) * (len(batch_shape) - len(lead)) + tuple(lead)",
    "  lead = tuple(lead) + (1,) * (len(batch_shape) - len(lead))",
    ("suites/core/test_attention.py", "-k", "fewer_batch_dims"),
    "A bias or mask with fewer batch dims than the query aligns them on the left, not the right.",
  ),
  Mutation(
    "attention.scale_default_value_dim",
    _ATTENTION + "spec.py",
    "    scale = 1.0 / math.sqrt(h)",
    "    scale = 1.0 / math.sqrt(v.shape[-1])",
    ("suites/core/test_attention.py", "-k", "value_head_dim_differs and xla]"),
    "The default scale from the value head dim instead of the query's.",
  ),
  Mutation(
    "validation.broadcast_rank_growth",
    "src/tokamax/_src/validation.py",
    "  if len(shape) > len(target) or any(",
    "  if any(",
    (_BAD_INPUT, "-k", "extra_leading_dim"),
    "An array with more dims than the target passes the broadcast check (its extra leading"
    " dims are never compared).",
  ),
  Mutation(
    "layer_norm.axis_minus_ndim_rejected",
    "src/tokamax/_src/ops/normalization/spec.py",
    "  if not isinstance(axis, int | np.integer) or not -x.ndim <= axis < x.ndim:",
    "  if not isinstance(axis, int | np.integer) or not -x.ndim < axis < x.ndim:",
    ("suites/core/test_layer_norm.py", "-k", "vector or minus_ndim"),
    "axis=-x.ndim (the first axis, counted from the end) is rejected.",
  ),
  Mutation(
    "layer_norm.zero_epsilon_rejected",
    "src/tokamax/_src/ops/normalization/spec.py",
    "  if not epsilon >= 0:",
    "  if not epsilon > 0:",
    ("suites/core/test_layer_norm.py", "-k", "zero_epsilon"),
    "epsilon=0 is rejected.",
  ),
  Mutation(
    "layer_norm.output_not_cast",
    "src/tokamax/_src/ops/normalization/spec.py",
    "  return y.astype(args.x.dtype)",
    "  return y",
    ("suites/core/test_layer_norm.py", "-k", "16_bit"),
    "LayerNorm of 16-bit inputs returns float32 (the statistics' dtype), not x's dtype.",
  ),
  Mutation(
    "layer_norm.scale_offset_without_scale",
    "src/tokamax/_src/ops/normalization/spec.py",
    "    return 1.0 + args.scale_offset",
    "    return 1.0",
    ("suites/core/test_layer_norm.py", "-k", "scale_offset"),
    "scale_offset is ignored when there is no scale.",
  ),
  Mutation(
    "glu.pair_k_unchecked",
    "src/tokamax/_src/ops/gated_linear_unit/spec.py",
    "      if w.ndim != 2 or w.shape[0] != k:",
    "      if w.ndim != 2:",
    (_BAD_INPUT, "-k", "glu"),
    "A (w_gate, w_up) pair whose K differs from x's is not rejected by name.",
  ),
  Mutation(
    "glu.pair_length_unchecked",
    "src/tokamax/_src/ops/gated_linear_unit/spec.py",
    "    if len(weights) != 2:",
    "    if len(weights) < 2:",
    (_BAD_INPUT, "-k", "glu"),
    "Three weight matrices are accepted as a (w_gate, w_up) pair.",
  ),
  Mutation(
    "ragged_dot.preferred_element_type_ignored",
    _RAGGED + "spec.py",
    "  out_dtype = np.dtype(preferred_element_type) if preferred_element_type is not None"
    " else lhs.dtype",
    "  out_dtype = lhs.dtype",
    ("suites/core/test_ragged_dot.py", "-k", "preferred"),
    "preferred_element_type is ignored: the output has the inputs' dtype.",
  ),
  Mutation(
    "ragged_dot.group_offset_shape_unchecked",
    _RAGGED + "spec.py",
    "    if group_offset.shape not in ((), (1,)):",
    "    if group_offset.ndim > 1:",
    (_BAD_INPUT, "-k", "group_offset_shape"),
    "A group_offset of several entries is not rejected by name.",
  ),
  Mutation(
    "ragged_dot.local_groups_unchecked",
    _RAGGED + "spec.py",
    "    if local > g_all:",
    "    if False:",
    (_BAD_INPUT, "-k", "local_groups"),
    "With a group offset, more local groups than group_sizes has are accepted.",
  ),
  Mutation(
    "ragged_dot.contracting_rows_unchecked",
    _RAGGED + "spec.py",
    "    if rhs.shape[0] != m:",
    "    if rhs.shape[0] > m:",
    (_BAD_INPUT, "-k", "contracting_rows"),
    "Ragged contracting: an rhs with fewer rows than lhs is not rejected by name.",
  ),
  Mutation(
    "ragged_dot.mixed_dtypes_accepted",
    _RAGGED + "spec.py",
    "  validation.same_dtype(lhs=lhs, rhs=rhs)",
    "  validation.same_dtype(lhs=lhs)",
    (_BAD_INPUT, "-k", "ragged_mixed"),
    "lhs and rhs of different dtypes are accepted.",
  ),
  Mutation(
    "ragged_dot.representative_length_unchecked",
    _RAGGED + "spec.py",
    "  if representative is not None and len(representative) != group_sizes.shape[0]:",
    "  if representative is not None and len(representative) < group_sizes.shape[0]:",
    (_BAD_INPUT, "-k", "representative"),
    "RaggedDotGroupSizes whose representative_value has more entries than groups is accepted.",
  ),
  Mutation(
    "loss.labels_length_unchecked",
    _LOSS + "spec.py",
    "  if labels.shape[0] != x.shape[0]:",
    "  if labels.shape[0] > x.shape[0]:",
    (_BAD_INPUT, "-k", "label_count"),
    "Fewer labels than rows of x are not rejected by name.",
  ),
  Mutation(
    "loss.negative_labels_accepted",
    _LOSS + "spec.py",
    "    if values.size and (values.min() < 0 or values.max() >= weights.shape[1]):",
    "    if values.size and values.max() >= weights.shape[1]:",
    (_BAD_INPUT, "-k", "label"),
    "Negative labels are accepted (and clipped to column 0).",
  ),
  Mutation(
    "loss.mixed_dtypes_accepted",
    _LOSS + "spec.py",
    "  validation.same_dtype(x=x, weights=weights)",
    "  validation.same_dtype(x=x)",
    (_BAD_INPUT, "-k", "loss_mixed"),
    "x and weights of different dtypes are accepted.",
  ),
  Mutation(
    "bench.vjp_cotangents_need_a_seed",
    "src/tokamax/_src/benchmarking.py",
    "    1 + (seed or 0),",
    "    seed,",
    ("suites/tooling/test_benchmarking.py", "-k", "needs_no_seed"),
    'standardize_function(mode="vjp", seed=None) fails on concrete arrays: the random'
    " cotangents take the (absent) seed.",
  ),
  Mutation(
    "bench.one_key_for_every_leaf",
    "src/tokamax/_src/benchmarking.py",
    "    random_array(jax.random.fold_in(root, i), x.shape, x.dtype)",
    "    random_array(root, x.shape, x.dtype)",
    ("suites/tooling/test_benchmarking.py", "-k", "different_values"),
    "Every ShapeDtypeStruct of one shape gets the same random values (q = k = v).",
  ),
  Mutation(
    "bench.single_iteration_rejected",
    "src/tokamax/_src/benchmarking.py",
    "  if iterations < 1:",
    "  if iterations <= 1:",
    ("suites/tooling/test_benchmarking.py", "-k", "one_iteration"),
    "benchmark(iterations=1) is rejected.",
  ),
  Mutation(
    "harness.shape_mismatch_broadcasts",
    _COMPARE,
    "  if a.shape != e.shape:\n    msg",
    "  if a.ndim != e.ndim:\n    msg",
    (_COTANGENTS, "-k", "another_shape"),
    "An output of another shape (of the same rank) is compared by broadcasting.",
  ),
  Mutation(
    "harness.assert_finite_misses_inf",
    _COMPARE,
    "    if not np.isfinite(v).all():",
    "    if np.isnan(v).any():",
    (_COTANGENTS, "-k", "assert_finite"),
    "assert_finite lets Inf through.",
  ),
  Mutation(
    "harness.bitwise_equal_by_value",
    _COMPARE,
    "    if not np.array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8)):",
    "    if not np.array_equal(x, y):",
    (_COTANGENTS, "-k", "bitwise"),
    "The determinism check compares values, not bits: 0.0 equals -0.0 and a NaN fails"
    " against itself.",
  ),
)


def by_id() -> dict[str, Mutation]:
  out = {}
  for m in MUTATIONS:
    if m.id in out:
      raise ValueError(f"duplicate mutation id {m.id!r}")
    out[m.id] = m
  return out
