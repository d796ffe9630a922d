"""Bad input raises ValueError/TypeError naming the argument."""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import tokamax
from tokamax._src.ops.ragged_dot import spec as ragged_spec

f32 = jnp.float32
Q = jnp.ones((2, 8, 4, 16), f32) * 0.5


def _one_device_sharding(*spec):
  """A NamedSharding of `spec` over a one-device mesh (the checks run before any split)."""
  return NamedSharding(Mesh(np.array(jax.devices()[:1]), ("x",)), PartitionSpec(*spec))


def attn(**overrides):
  args = dict(query=Q, key=Q, value=Q)
  args.update(overrides)
  q, k, v = args.pop("query"), args.pop("key"), args.pop("value")
  return tokamax.dot_product_attention(q, k, v, **args)


CASES = {
  "attention_rank": (lambda: attn(query=Q[0, 0]), ValueError, "query"),
  "attention_heads_not_multiple": (
    lambda: attn(key=jnp.ones((2, 8, 3, 16)), value=jnp.ones((2, 8, 3, 16))),
    ValueError,
    "multiple",
  ),
  "attention_head_dim_mismatch": (
    lambda: attn(key=jnp.ones((2, 8, 4, 8)), value=jnp.ones((2, 8, 4, 8))),
    ValueError,
    "head dim",
  ),
  "attention_int_query": (
    lambda: attn(query=jnp.ones((2, 8, 4, 16), jnp.int32)),
    TypeError,
    "query",
  ),
  # Complex is inexact but not floating: the softmax has no order on it.
  "attention_complex_inputs": (
    lambda: attn(query=Q.astype(jnp.complex64), key=Q.astype(jnp.complex64)),
    TypeError,
    "`query` must have a floating dtype",
  ),
  "attention_mixed_dtypes": (lambda: attn(key=Q.astype(jnp.bfloat16)), TypeError, "dtype"),
  "attention_value_len": (lambda: attn(value=jnp.ones((2, 7, 4, 16))), ValueError, "value"),
  "attention_bias_shape": (lambda: attn(bias=jnp.ones((2, 4, 8, 5))), ValueError, "bias"),
  "attention_mask_dtype": (lambda: attn(mask=jnp.ones((2, 4, 8, 8))), TypeError, "mask"),
  "attention_scale_not_a_number": (lambda: attn(scale="a"), TypeError, "`scale` must be a number"),
  # A bool is an int to Python: True would silently mean a scale of 1.
  "attention_scale_bool": (lambda: attn(scale=True), TypeError, "`scale` must be a number"),
  "attention_scale_nan": (lambda: attn(scale=float("nan")), ValueError, "`scale` must be finite"),
  "attention_soft_cap_not_a_number": (
    lambda: attn(logits_soft_cap="a"),
    TypeError,
    "`logits_soft_cap` must be a number",
  ),
  # A truthy word: "no" would have meant causal.
  "attention_causal_word": (lambda: attn(is_causal="no"), TypeError, "`is_causal` must be a bool"),
  "attention_negative_window": (
    lambda: attn(local_window_size=(-1, 2)),
    ValueError,
    "local_window_size",
  ),
  # The right side is checked too, not only the left.
  "attention_negative_right_window": (
    lambda: attn(local_window_size=(2, -1)),
    ValueError,
    "must be non-negative",
  ),
  "attention_float_window": (
    lambda: attn(local_window_size=1.5),
    ValueError,
    "local_window_size",
  ),
  "attention_bool_window": (
    lambda: attn(local_window_size=(True, 2)),
    ValueError,
    "local_window_size",
  ),
  "attention_string_precision": (lambda: attn(precision="bogus"), ValueError, "precision"),
  "attention_bad_window": (
    lambda: attn(local_window_size=(1, 2, 3)),
    ValueError,
    "local_window_size",
  ),
  "attention_float_lengths": (
    lambda: attn(query_seq_lengths=jnp.ones((2,))),
    TypeError,
    "query_seq_lengths",
  ),
  # Booleans are no lengths (True would silently mean 1).
  "attention_bool_lengths": (
    lambda: attn(key_value_seq_lengths=jnp.array([True, False])),
    TypeError,
    "`key_value_seq_lengths` must have an integer dtype",
  ),
  "attention_soft_cap": (lambda: attn(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
  "attention_zero_soft_cap": (lambda: attn(logits_soft_cap=0.0), ValueError, "logits_soft_cap"),
  # Head dim 0: the default scale 1/sqrt(0) is undefined (an explicit scale is fine).
  "attention_zero_head_dim_default_scale": (
    lambda: attn(query=jnp.ones((2, 8, 4, 0)), key=jnp.ones((2, 8, 4, 0))),
    ValueError,
    "`query` head dim is 0",
  ),
  "attention_key_batch_dims": (
    lambda: attn(key=jnp.ones((3, 8, 4, 16)), value=jnp.ones((3, 8, 4, 16))),
    ValueError,
    "`key` batch dims",
  ),
  # The value's batch dims too (batch dims (2, 3) against (3, 2) would reshape silently).
  "attention_value_batch_dims": (
    lambda: attn(value=jnp.ones((3, 8, 4, 16))),
    ValueError,
    "`value` batch dims",
  ),
  "attention_value_heads": (lambda: attn(value=jnp.ones((2, 8, 2, 16))), ValueError, "value"),
  "attention_mask_shape": (
    lambda: attn(mask=jnp.ones((2, 4, 8, 5), bool)),
    ValueError,
    "`mask`",
  ),
  "attention_bias_extra_leading_dim": (
    lambda: attn(bias=jnp.ones((3, 2, 4, 8, 8))),
    ValueError,
    "`bias`",
  ),
  # Lined up from the trailing dims: (2, 4) matches the leading (B, N) but not (T, S).
  "attention_bias_low_rank_misaligned": (
    lambda: attn(bias=jnp.ones((2, 4))),
    ValueError,
    "`bias`",
  ),
  "attention_lengths_shape": (
    lambda: attn(key_value_seq_lengths=jnp.array([3, 4, 5])),
    ValueError,
    "`key_value_seq_lengths`",
  ),
  "attention_int_bias": (
    lambda: attn(bias=jnp.ones((2, 4, 8, 8), jnp.int32)),
    TypeError,
    "`bias`",
  ),
  "attention_value_none": (lambda: attn(value=None), TypeError, "`value` must be an array"),
  "attention_bias_not_an_array": (lambda: attn(bias="bias"), TypeError, "`bias` must be an array"),
  "attention_mask_not_an_array": (lambda: attn(mask="mask"), TypeError, "`mask` must be an array"),
  "attention_value_dtype": (lambda: attn(value=Q.astype(jnp.bfloat16)), TypeError, "`value`"),
  "attention_value_rank": (
    lambda: attn(value=Q[None]),
    ValueError,
    "`query`, `key` and `value` must have one rank",
  ),
  "attention_all_rank_2": (
    lambda: attn(query=Q[0, 0], key=Q[0, 0], value=Q[0, 0]),
    ValueError,
    re.escape("`query` must have rank >= 3 (query [*B,T,N,H]"),
  ),
  "attention_q_sharding_not_named": (
    lambda: attn(q_sharding=PartitionSpec("x")),
    TypeError,
    "`q_sharding` must be a NamedSharding",
  ),
  "attention_q_sharding_longer_than_query": (
    lambda: attn(q_sharding=_one_device_sharding(None, None, None, None, None)),
    ValueError,
    "more entries than query dims",
  ),
  "attention_q_sharding_splits_t": (
    lambda: attn(q_sharding=_one_device_sharding(None, "x")),
    ValueError,
    "splitting T or H",
  ),
  "attention_q_sharding_splits_h": (
    lambda: attn(q_sharding=_one_device_sharding(None, None, None, "x")),
    ValueError,
    "splitting T or H",
  ),
  "norm_scale_offset_not_a_number": (
    lambda: tokamax.layer_norm(jnp.ones((4, 8)), jnp.ones(8), None, scale_offset="a"),
    TypeError,
    "`scale_offset` must be a number",
  ),
  "norm_epsilon_not_a_number": (
    lambda: tokamax.layer_norm(jnp.ones((4, 8)), None, None, epsilon="1e-6"),
    TypeError,
    "`epsilon` must be a number",
  ),
  "norm_epsilon_bytes": (
    lambda: tokamax.layer_norm(jnp.ones((4, 8)), None, None, epsilon=b"1e-6"),
    TypeError,
    "`epsilon` must be a number",
  ),
  "norm_subtract_mean_word": (
    lambda: tokamax.layer_norm(jnp.ones((4, 8)), None, None, subtract_mean="no"),
    TypeError,
    "`subtract_mean` must be a bool",
  ),
  # Infinite numbers: an infinite epsilon zeroes every output, an infinite scale_offset
  # gives NaN or infinities.
  "norm_scale_offset_infinite": (
    lambda: tokamax.layer_norm(jnp.ones((4, 8)), jnp.ones(8), None, scale_offset=float("inf")),
    ValueError,
    "`scale_offset` must be finite",
  ),
  "norm_epsilon_infinite": (
    lambda: tokamax.layer_norm(jnp.ones((4, 8)), None, None, epsilon=np.inf),
    ValueError,
    "`epsilon` must be finite",
  ),
  "attention_soft_cap_infinite": (
    lambda: attn(logits_soft_cap=-np.inf),
    ValueError,
    "`logits_soft_cap` must be finite",
  ),
  # A one-element boolean array is no flag: one per row (or per call of a batch) was meant.
  "norm_subtract_mean_one_element_array": (
    lambda: tokamax.layer_norm(jnp.ones((4, 8)), None, None, subtract_mean=np.array([True])),
    TypeError,
    "`subtract_mean` must be a bool",
  ),
  "attention_causal_one_element_array": (
    lambda: attn(is_causal=jnp.array([False])),
    TypeError,
    "`is_causal` must be a bool",
  ),
  "norm_scale_shape": (
    lambda: tokamax.layer_norm(jnp.ones((4, 8)), jnp.ones(7), None),
    ValueError,
    "scale",
  ),
  "norm_offset_shape": (
    lambda: tokamax.layer_norm(jnp.ones((4, 8)), jnp.ones(8), jnp.ones(7)),
    ValueError,
    "`offset`",
  ),
  "norm_scale_rank": (
    lambda: tokamax.layer_norm(jnp.ones((4, 8)), jnp.ones((1, 8)), None),
    ValueError,
    "`scale`",
  ),
  "norm_offset_rank": (
    lambda: tokamax.layer_norm(jnp.ones((4, 8)), None, jnp.ones((8, 1))),
    ValueError,
    "`offset`",
  ),
  "norm_negative_epsilon": (
    lambda: tokamax.layer_norm(jnp.ones((4, 8)), None, None, epsilon=-1e-6),
    ValueError,
    "`epsilon` must be >= 0",  # The bound it is held to: epsilon=0 is accepted.
  ),
  "norm_axis": (
    lambda: tokamax.layer_norm(jnp.ones((4, 8)), None, None, axis=2),
    ValueError,
    "axis",
  ),
  "norm_float_axis": (
    lambda: tokamax.layer_norm(jnp.ones((4, 8)), None, None, axis=0.5),
    ValueError,
    "`axis` must be an int",
  ),
  "norm_int_x": (
    lambda: tokamax.layer_norm(jnp.ones((4, 8), jnp.int32), None, None),
    TypeError,
    "x",
  ),
  "glu_x_rank": (
    lambda: tokamax.gated_linear_unit(jnp.ones((8,)), jnp.ones((8, 2, 5))),
    ValueError,
    re.escape("`x` must have rank >= 2 (x [*B, M, K])"),
  ),
  "glu_weights_shape": (
    lambda: tokamax.gated_linear_unit(jnp.ones((4, 8)), jnp.ones((8, 3, 5))),
    ValueError,
    "weights",
  ),
  "glu_weights_k": (
    lambda: tokamax.gated_linear_unit(jnp.ones((4, 8)), jnp.ones((6, 2, 5))),
    ValueError,
    "weights",
  ),
  "glu_pair_mismatch": (
    lambda: tokamax.gated_linear_unit(jnp.ones((4, 8)), (jnp.ones((8, 5)), jnp.ones((8, 4)))),
    ValueError,
    "w_gate",
  ),
  "glu_pair_k": (
    lambda: tokamax.gated_linear_unit(jnp.ones((4, 8)), (jnp.ones((6, 5)), jnp.ones((6, 5)))),
    ValueError,
    "`weights",
  ),
  "glu_three_weights": (
    lambda: tokamax.gated_linear_unit(jnp.ones((4, 8)), (jnp.ones((8, 5)),) * 3),
    ValueError,
    "`weights`",
  ),
  "norm_axis_minus_ndim_minus_one": (
    lambda: tokamax.layer_norm(jnp.ones((4, 8)), None, None, axis=-3),
    ValueError,
    "axis",
  ),
  # Rank 3 with the pair's shapes equal: the einsum, not the check, would fail.
  "glu_pair_rank": (
    lambda: tokamax.gated_linear_unit(jnp.ones((4, 8)), (jnp.ones((8, 5, 1)),) * 2),
    ValueError,
    re.escape("`weights[0]` must have shape [K=8, N]"),
  ),
  # Rank 2 of K rows and 2 columns: the [K, 2, N] check must count the dims.
  "glu_fused_rank_2": (
    lambda: tokamax.gated_linear_unit(jnp.ones((4, 8)), jnp.ones((8, 2))),
    ValueError,
    re.escape("`weights` must have shape [K=8, 2, N]"),
  ),
  # Without the check an int32 x would be promoted by the matmul: a silent answer.
  "glu_int_x": (
    lambda: tokamax.gated_linear_unit(jnp.ones((4, 8), jnp.int32), jnp.ones((8, 2, 5))),
    TypeError,
    "`x` must have a floating dtype",
  ),
  # The pair's second weight is checked too, not only the gate's.
  "glu_int_up_weight": (
    lambda: tokamax.gated_linear_unit(
      jnp.ones((4, 8)), (jnp.ones((8, 5)), jnp.ones((8, 5), jnp.int32))
    ),
    TypeError,
    re.escape("`weights[1]` must have a floating dtype"),
  ),
  "glu_activation": (
    lambda: tokamax.gated_linear_unit(jnp.ones((4, 8)), jnp.ones((8, 2, 5)), activation="swish"),
    TypeError,
    "activation",
  ),
  "ragged_group_count": (
    lambda: tokamax.ragged_dot(jnp.ones((6, 4)), jnp.ones((3, 4, 5)), jnp.array([2, 4])),
    ValueError,
    "group_sizes",
  ),
  # More sizes than rhs has groups: jax.lax's own error would not name `group_sizes`.
  "ragged_more_sizes_than_groups": (
    lambda: tokamax.ragged_dot(jnp.ones((6, 4)), jnp.ones((2, 4, 5)), jnp.array([2, 2, 2])),
    ValueError,
    "`group_sizes` must have one entry per group",
  ),
  "ragged_negative_group_size": (
    lambda: tokamax.ragged_dot(jnp.ones((6, 4)), jnp.ones((2, 4, 5)), jnp.array([7, -1])),
    ValueError,
    re.escape("`group_sizes` must lie in [0, inf), got [-1, 7]"),
  ),
  "ragged_lhs_rank": (
    lambda: tokamax.ragged_dot(jnp.ones((2, 6, 4)), jnp.ones((2, 4, 5)), jnp.array([2, 4])),
    ValueError,
    re.escape("`lhs` must have rank 2 (lhs [M, K])"),
  ),
  "ragged_int_rhs": (
    lambda: tokamax.ragged_dot(jnp.ones((6, 4)), jnp.ones((2, 4, 5), jnp.int32), jnp.array([2, 4])),
    TypeError,
    "`rhs` must have a floating dtype",
  ),
  "ragged_group_dtype": (
    lambda: tokamax.ragged_dot(jnp.ones((6, 4)), jnp.ones((2, 4, 5)), jnp.array([2.0, 4.0])),
    TypeError,
    "group_sizes",
  ),
  "ragged_preferred_type_not_a_dtype": (
    lambda: tokamax.ragged_dot(
      jnp.ones((6, 4)), jnp.ones((2, 4, 5)), jnp.array([2, 4]), preferred_element_type="bogus"
    ),
    TypeError,
    "`preferred_element_type` must be a dtype",
  ),
  "ragged_k_mismatch": (
    lambda: tokamax.ragged_dot(jnp.ones((6, 4)), jnp.ones((2, 3, 5)), jnp.array([2, 4])),
    ValueError,
    "rhs",
  ),
  "ragged_int_lhs": (
    lambda: tokamax.ragged_dot(jnp.ones((6, 4), jnp.int32), jnp.ones((2, 4, 5)), jnp.array([2, 4])),
    TypeError,
    "lhs",
  ),
  "ragged_group_sizes_rank": (
    lambda: tokamax.ragged_dot(jnp.ones((6, 4)), jnp.ones((2, 4, 5)), jnp.ones((2, 1), jnp.int32)),
    ValueError,
    "group_sizes",
  ),
  "ragged_unsupported_dims": (
    lambda: tokamax.ragged_dot_general(
      jnp.ones((6, 4)),
      jnp.ones((2, 4, 5)),
      jnp.array([2, 4]),
      jax.lax.RaggedDotDimensionNumbers((([1], [1]), ([], [])), [1], [0]),
    ),
    NotImplementedError,
    "ragged_dot_dimension_numbers",
  ),
  # rhs [N, G, K]: the group dimension second. Not the "rhs_transposed" layout [G, N, K].
  "ragged_rhs_group_dim_second": (
    lambda: tokamax.ragged_dot_general(
      jnp.ones((6, 4)),
      jnp.ones((5, 2, 4)),
      jnp.array([2, 4]),
      jax.lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), [0], [1]),
    ),
    NotImplementedError,
    "ragged_dot_dimension_numbers",
  ),
  # A batch dimension on top of the "default" layout's contraction and groups.
  "ragged_batch_dims": (
    lambda: tokamax.ragged_dot_general(
      jnp.ones((6, 4)),
      jnp.ones((2, 4, 5)),
      jnp.array([2, 4]),
      jax.lax.RaggedDotDimensionNumbers((([1], [1]), ([0], [0])), [0], [0]),
    ),
    NotImplementedError,
    "ragged_dot_dimension_numbers",
  ),
  # The ragged contracting layout's rhs is [M, N], rows of lhs by output columns.
  "ragged_contracting_rhs_rank": (
    lambda: tokamax.ragged_dot_general(
      jnp.ones((6, 4)),
      jnp.ones((6, 5, 2)),
      jnp.array([2, 4]),
      jax.lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), [0], []),
    ),
    ValueError,
    "rhs .M, N. for a ragged contracting dimension",
  ),
  "ragged_mixed_dtypes": (
    lambda: tokamax.ragged_dot(
      jnp.ones((6, 4)), jnp.ones((2, 4, 5), jnp.bfloat16), jnp.array([2, 4])
    ),
    TypeError,
    "dtype",
  ),
  "ragged_float_group_offset": (
    lambda: tokamax.ragged_dot(
      jnp.ones((6, 4)), jnp.ones((2, 4, 5)), jnp.array([2, 4]), group_offset=jnp.array([0.0])
    ),
    TypeError,
    "group_offset",
  ),
  "ragged_rhs_rank": (
    lambda: tokamax.ragged_dot(jnp.ones((6, 4)), jnp.ones((2, 4)), jnp.array([2, 4])),
    ValueError,
    re.escape("`rhs` must have rank 3 (rhs [G, K, N])"),
  ),
  "ragged_group_offset_shape": (
    lambda: tokamax.ragged_dot(
      jnp.ones((6, 4)), jnp.ones((2, 4, 5)), jnp.array([2, 4]), group_offset=jnp.array([0, 1])
    ),
    ValueError,
    "`group_offset`",
  ),
  "ragged_more_local_groups_than_sizes": (
    lambda: tokamax.ragged_dot(
      jnp.ones((6, 4)), jnp.ones((3, 4, 5)), jnp.array([2, 4]), group_offset=jnp.array([0])
    ),
    ValueError,
    "`group_sizes`",
  ),
  "ragged_contracting_rows": (
    lambda: tokamax.ragged_dot_general(
      jnp.ones((6, 4)),
      jnp.ones((4, 5)),
      jnp.array([2, 4]),
      ragged_spec.dimension_numbers(ragged_spec.RAGGED_CONTRACTING),
    ),
    ValueError,
    "`rhs`",
  ),
  "ragged_representative_length": (
    lambda: tokamax.ragged_dot(
      jnp.ones((6, 4)),
      jnp.ones((2, 4, 5)),
      tokamax.RaggedDotGroupSizes(jnp.array([2, 4]), (2, 2, 2)),
    ),
    ValueError,
    "representative_value",
  ),
  "loss_reduction": (
    lambda: tokamax.linear_softmax_cross_entropy_loss(
      jnp.ones((4, 8)), jnp.zeros(4, jnp.int32), jnp.ones((8, 5)), reduction="max"
    ),
    ValueError,
    "reduction",
  ),
  "loss_label_range": (
    lambda: tokamax.linear_softmax_cross_entropy_loss(
      jnp.ones((4, 8)), jnp.array([0, 1, 5, 2]), jnp.ones((8, 5))
    ),
    ValueError,
    "labels",
  ),
  "loss_labels_rank": (
    lambda: tokamax.linear_softmax_cross_entropy_loss(
      jnp.ones((4, 8)), jnp.zeros((4, 1), jnp.int32), jnp.ones((8, 5))
    ),
    ValueError,
    "`labels`",
  ),
  "loss_weights_rank": (
    lambda: tokamax.linear_softmax_cross_entropy_loss(
      jnp.ones((4, 8)), jnp.zeros(4, jnp.int32), jnp.ones((8, 5, 1))
    ),
    ValueError,
    "`weights`",
  ),
  "loss_x_rank": (
    lambda: tokamax.linear_softmax_cross_entropy_loss(
      jnp.ones((2, 8, 8)), jnp.zeros(2, jnp.int32), jnp.ones((8, 5))
    ),
    ValueError,
    re.escape("`x` must have rank 2 (x [B, H])"),
  ),
  "loss_float_labels": (
    lambda: tokamax.linear_softmax_cross_entropy_loss(
      jnp.ones((4, 8)), jnp.zeros(4), jnp.ones((8, 5))
    ),
    TypeError,
    "labels",
  ),
  "loss_weight_rows": (
    lambda: tokamax.linear_softmax_cross_entropy_loss(
      jnp.ones((4, 8)), jnp.zeros(4, jnp.int32), jnp.ones((7, 5))
    ),
    ValueError,
    "weights",
  ),
  # The message names x's row count (4), not its feature count (8).
  "loss_label_count": (
    lambda: tokamax.linear_softmax_cross_entropy_loss(
      jnp.ones((4, 8)), jnp.zeros(3, jnp.int32), jnp.ones((8, 5))
    ),
    ValueError,
    re.escape("`labels` length 3 must equal `x` rows 4"),
  ),
  "loss_negative_label": (
    lambda: tokamax.linear_softmax_cross_entropy_loss(
      jnp.ones((4, 8)), jnp.array([0, -1, 2, 1]), jnp.ones((8, 5))
    ),
    ValueError,
    "`labels`",
  ),
  "loss_int_x": (
    lambda: tokamax.linear_softmax_cross_entropy_loss(
      jnp.ones((4, 8), jnp.int32), jnp.zeros(4, jnp.int32), jnp.ones((8, 5))
    ),
    TypeError,
    "`x` must have a floating dtype",
  ),
  "loss_mixed_dtypes": (
    lambda: tokamax.linear_softmax_cross_entropy_loss(
      jnp.ones((4, 8), jnp.bfloat16), jnp.zeros(4, jnp.int32), jnp.ones((8, 5))
    ),
    TypeError,
    "dtype",
  ),
}


@pytest.mark.parametrize("name", CASES)
def test_bad_input_is_named(name):
  call, error, word = CASES[name]
  with pytest.raises(error, match=word):
    call()


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 0, 1, np.int32(1), jnp.array(True)])
def test_flags_take_bools_numpy_bools_zero_and_one(value):
  q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 6, 2, 8)), jnp.float32)
  out = tokamax.dot_product_attention(q, q, q, is_causal=value)
  ref = tokamax.dot_product_attention(q, q, q, is_causal=bool(value))
  np.testing.assert_array_equal(out, ref)
  x = q.reshape(12, 8)
  np.testing.assert_array_equal(
    tokamax.layer_norm(x, None, None, subtract_mean=value),
    tokamax.layer_norm(x, None, None, subtract_mean=bool(value)),
  )


@pytest.mark.parametrize("size", (0, -4))
def test_chunk_sizes_must_be_positive(size):
  from tokamax._src.ops.attention import xla_chunked
  from tokamax._src.ops.linear_softmax_cross_entropy_loss import chunked_xla

  with pytest.raises(ValueError, match="kv_chunk_size"):
    xla_chunked.ChunkedConfig(kv_chunk_size=size)
  with pytest.raises(ValueError, match="vocab_chunk_size"):
    chunked_xla.ChunkedLossConfig(vocab_chunk_size=size)


def test_chunks_of_one_key_or_one_column_serve():
  """The smallest positive chunk sizes are accepted and match the float64 references."""
  from tokamax._src.ops.attention import xla_chunked
  from tokamax._src.ops.linear_softmax_cross_entropy_loss import chunked_xla
  from tokamax_harness import references

  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((8, 5)), jnp.float32)
  labels = jnp.array([0, 4, 2, 1], jnp.int32)
  one = chunked_xla.ChunkedXlaLoss(config=chunked_xla.ChunkedLossConfig(vocab_chunk_size=1))
  np.testing.assert_allclose(
    tokamax.linear_softmax_cross_entropy_loss(x, labels, w, implementation=one),
    references.high_precision(references.linear_softmax_cross_entropy_loss)(x, labels, w),
    rtol=1e-5,
  )
  q = jnp.asarray(rng.standard_normal((1, 3, 2, 8)), jnp.float32)
  kv = jnp.asarray(rng.standard_normal((1, 5, 2, 8)), jnp.float32)
  key = xla_chunked.XlaChunkedAttention(config=xla_chunked.ChunkedConfig(kv_chunk_size=1))
  np.testing.assert_allclose(
    tokamax.dot_product_attention(q, kv, kv, implementation=key),
    references.high_precision(references.attention)(q, kv, kv),
    rtol=1e-5,
    atol=1e-6,
  )


def test_precision_is_none_one_precision_or_a_pair():
  from tokamax._src import validation

  P = jax.lax.Precision
  assert validation.precision(None) is None
  assert validation.precision("highest") == P.HIGHEST
  assert validation.precision(("high", None)) == (P.HIGH, None)
  for bad in ((P.HIGH,) * 3, (P.HIGH,), [P.HIGH, P.HIGH], 3):
    with pytest.raises(ValueError, match="or a pair"):
      validation.precision(bad)


def test_broadcastable_accepts_exactly_what_numpy_broadcasts_to_the_target():
  """Every shape of rank <= 5 built from 1, the target's dim or another size is accepted iff
  NumPy broadcasts it to the target unchanged (so its rank may not grow past the target's)."""
  from tokamax._src import validation

  target = (2, 3, 5, 7)
  for r in range(6):
    right = (1, *target)[-r:] if r else ()
    for shape in itertools.product(*[(1, d, d + 2) for d in right]):
      try:
        want = np.broadcast_shapes(shape, target) == target
      except ValueError:
        want = False
      if want:
        validation.broadcastable("mask", shape, target, "[*B, N, T, S]")
      else:
        with pytest.raises(ValueError, match=re.escape(f"`mask` of shape {shape}")):
          validation.broadcastable("mask", shape, target, "[*B, N, T, S]")


def test_a_bool_option_takes_bools_only():
  from tokamax._src import config

  with pytest.raises(TypeError, match="use_default_cache"), config.override(use_default_cache="no"):
    pass
  with pytest.raises(ValueError, match="cache_miss"), config.override(cache_miss="sometimes"):
    pass
  with pytest.raises(TypeError, match="use_default_cache"), config.override(use_default_cache=2):
    pass
  with config.override(use_default_cache=False) as options:
    assert options.use_default_cache is False


@pytest.mark.parametrize(
  ("value", "expected"),
  [("0", False), ("false", False), ("Off", False), ("1", True), ("yes", True), ("", True)],
)
def test_env_flag_reads_words_and_digits(monkeypatch, value, expected):
  from tokamax._src import config

  monkeypatch.setenv("TOKAMAX_TEST_FLAG", value)
  assert config._env_flag("TOKAMAX_TEST_FLAG", default=True) is expected


def test_env_flag_refuses_other_values(monkeypatch):
  from tokamax._src import config

  monkeypatch.setenv("TOKAMAX_TEST_FLAG", "maybe")
  with pytest.raises(ValueError, match="TOKAMAX_TEST_FLAG='maybe'"):
    config._env_flag("TOKAMAX_TEST_FLAG", default=True)


@pytest.mark.parametrize(("value", "expected"), [(" 0 ", False), ("\tOn\n", True)])
def test_env_flag_ignores_surrounding_whitespace(monkeypatch, value, expected):
  from tokamax._src import config

  monkeypatch.setenv("TOKAMAX_TEST_FLAG", value)
  assert config._env_flag("TOKAMAX_TEST_FLAG", default=not expected) is expected


@pytest.mark.parametrize("value", [None, "", "  "])
def test_an_unset_or_empty_env_flag_takes_its_default(monkeypatch, value):
  from tokamax._src import config

  if value is None:
    monkeypatch.delenv("TOKAMAX_TEST_FLAG", raising=False)
  else:
    monkeypatch.setenv("TOKAMAX_TEST_FLAG", value)
  assert config._env_flag("TOKAMAX_TEST_FLAG", default=False) is False
  assert config._env_flag("TOKAMAX_TEST_FLAG", default=True) is True


def test_a_bool_option_takes_numpy_bools():
  from tokamax._src import config

  with config.override(use_default_cache=np.False_) as options:
    assert options.use_default_cache is False
  with config.override(use_default_cache=np.True_) as options:
    assert options.use_default_cache is True
