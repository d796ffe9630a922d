"""Kernels on sharded arrays (issue 21): the partitioning planner, and every case of
suites/core/kernel_sharding_checks.py on 8 host devices (one subprocess for all)."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from suites.core import kernel_sharding_checks
from tokamax._src.ops import partitioning, registry
from tokamax._src.ops.attention import spec as attention_spec
from tokamax._src.ops.linear_softmax_cross_entropy_loss import spec as loss_spec
from tokamax._src.ops.normalization import spec as norm_spec
from tokamax._src.ops.ragged_dot import spec as ragged_spec

# The first test waits for the module fixture, which runs every case in one subprocess (~160 s
# on CI; its own limit 900 s), over the suite's per-test timeout.
pytestmark = pytest.mark.timeout(960)

MESH = {"data": 4, "model": 2}
NAMES = [*kernel_sharding_checks.cases(), *kernel_sharding_checks.lowerings()]
_SPECS = {
  attention_spec.AttentionArgs: attention_spec,
  loss_spec.LossArgs: loss_spec,
  norm_spec.NormArgs: norm_spec,
  ragged_spec.RaggedDotArgs: ragged_spec,
}


def _plan(name, args, *specs):
  """The plan of the op's own rule for `args` sharded by `specs`, on MESH."""
  rule = _SPECS[type(args)].partitioning(args)
  leaves = jax.tree.leaves(args)
  return partitioning.plan(
    name, rule, rule.leaf_labels(args), [x.shape for x in leaves], specs, MESH
  )


def test_every_kernel_of_a_partitioned_op_is_partitioned():
  """Kernels (not JAX-traceable) follow their op's rule; XLA and cuDNN are left to XLA but
  on explicit mesh axes (the `explicit_` cases)."""
  for spec in registry.SPECS.values():
    assert spec.partitioning is not None, spec.name
    for name in spec.implementation_names:
      cls = spec.implementation_class_or_reason(name)
      if isinstance(cls, str):
        continue
      partitioned = cls.partitioned if cls.partitioned is not None else not cls.differentiable
      xla_level = ("xla", "xla_chunked", "chunked_xla", "cudnn")
      assert partitioned == (name not in xla_level), (spec.name, name)


def test_rows_split_and_an_unsplittable_axis_warns_once():
  args = norm_spec.canonicalize(jnp.ones((8, 6, 4)), jnp.ones(4), None)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):
      plan = _plan("test_norm_once", args, P("data", None, "model"), P())
  assert plan.in_specs == (P(("data",), None, None), P(None))
  assert plan.grad_sums == ((), ("data",))  # scale's cotangent sums over the rows' devices
  assert [str(w.message) for w in caught] == [
    "test_norm_once: axis 2 (d) of `x` is sharded over mesh axes ('model',), which this op "
    "cannot split; it is replicated on every device."
  ]


def test_an_axis_the_devices_do_not_divide_is_replicated():
  """6 rows over the 4 devices of "data" cannot split evenly: they stay whole (and warn)."""
  args = norm_spec.canonicalize(jnp.ones((6, 4)), jnp.ones(4), None)
  with pytest.warns(
    UserWarning, match=r"axis 0 \(r0\) of `x` is sharded over mesh axes \('data',\)"
  ):
    plan = _plan("test_norm_indivisible", args, P("data"), P())
  assert plan.in_specs == (P(None, None), P(None)) and not plan.splits


def test_a_mesh_axis_splits_one_label_only():
  """lhs rows and rhs groups both sharded over "data": the rows take it (first come), the
  groups stay whole, so no device holds a shard of both that the other's shard misses."""
  args = ragged_spec.canonicalize(jnp.ones((16, 8)), jnp.ones((4, 8, 6)), jnp.full(4, 4))
  with pytest.warns(UserWarning, match=r"axis 0 \(g\) of `rhs`"):
    plan = _plan("test_ragged_one_axis", args, P("data"), P("data"), P())
  assert set(plan.shards) == {"m"}
  assert plan.in_specs[:2] == (P(("data",), None), P(None, None, None))
  assert not plan.out_sums


def test_a_replicated_axis_warns_for_each_field():
  """Key and value sequences (one label, one axis) sharded where the op cannot split them:
  both fields are named, once each."""
  q, kv = jnp.ones((4, 8, 4, 16)), jnp.ones((4, 8, 2, 16))
  args = attention_spec.canonicalize(q, kv, kv)
  sequence = P(None, "model")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):
      plan = _plan("test_kv_sequence", args, P(), sequence, sequence)
  assert not plan.splits
  assert sorted(str(w.message).split("`")[1] for w in caught) == ["key", "value"]
  assert all("axis 1 (s)" in str(w.message) for w in caught)


def test_rules_that_do_not_fit_the_arrays_are_refused():
  """Labels of the wrong rank, or for the wrong number of arrays: an error naming the field."""
  args = norm_spec.canonicalize(jnp.ones((8, 4)), jnp.ones(4), None)

  def rule(x_labels):
    return partitioning.Rule(
      inputs={"x": x_labels, "scale": ("d",)}, output=("r0", "d"), split=frozenset({"r0"})
    )

  with pytest.raises(ValueError, match=r"rule labels \('r0',\) for 'x' of rank 2"):
    rule(("r0",)).leaf_labels(args)
  with pytest.raises(ValueError, match="rule names 2 arrays for field 'x', not 1"):
    rule([("r0", "d"), ("r0", "d")]).leaf_labels(args)
  assert rule(("r0", "d")).leaf_labels(args) == [("x", ("r0", "d")), ("scale", ("d",))]


def test_a_field_the_rule_does_not_name_never_splits():
  """`Rule.inputs` leaves out `scale`: its axis takes the label None (never split), so
  a scale sharded over "model" is replicated (with the warning) while the rows split."""
  args = norm_spec.canonicalize(jnp.ones((8, 4)), jnp.ones(4), None)
  rule = partitioning.Rule(inputs={"x": ("r0", "d")}, output=("r0", "d"), split=frozenset({"r0"}))
  labels = rule.leaf_labels(args)
  assert labels == [("x", ("r0", "d")), ("scale", (None,))]
  with pytest.warns(UserWarning, match=r"axis 0 \(unnamed\) of `scale`"):
    plan = partitioning.plan(
      "test_unnamed_field", rule, labels, [(8, 4), (4,)], [P("data"), P("model")], MESH
    )
  assert plan.in_specs == (P(("data",), None), P(None))


def test_kv_heads_split_with_their_query_groups():
  q, kv = jnp.ones((4, 8, 4, 16)), jnp.ones((4, 8, 2, 16))
  args = attention_spec.canonicalize(q, kv, kv)
  heads = P("data", None, "model")
  plan = _plan("test_gqa", args, heads, heads, heads)
  assert plan.in_specs[0] == P(("data",), None, ("model",), None)
  assert plan.out_spec == plan.in_specs[0] and not plan.out_sums
  # Every operand holds both split labels (the query's as the major factor of its compound
  # head axis): each shard's cotangents are whole, summed over no mesh axis.
  assert plan.grad_sums == ((), (), ())


def test_query_heads_of_a_single_kv_head_are_replicated():
  q, kv = jnp.ones((4, 8, 4, 16)), jnp.ones((4, 8, 1, 16))
  args = attention_spec.canonicalize(q, kv, kv)
  with pytest.warns(UserWarning, match=r"axis 2 \(\('k', 'g'\)\) of `query`"):
    plan = _plan("test_mqa", args, P("data", None, "model"), P("data"), P("data"))
  assert plan.in_specs[0] == P(("data",), None, None, None)


def test_expert_parallel_groups_sum_the_output():
  args = ragged_spec.canonicalize(jnp.ones((16, 8)), jnp.ones((4, 8, 6)), jnp.full(4, 4))
  plan = _plan("test_ragged", args, P("data"), P("model"), P())
  assert set(plan.shards) == {"m", "g"}
  assert plan.out_spec == P(("data",), None) and plan.out_sums == ("model",)
  assert plan.grad_sums[0] == ("model",)  # lhs meets only its devices' groups


def test_vocabulary_shards_add_their_shares_of_the_loss():
  x, labels, w = jnp.ones((16, 8)), jnp.zeros(16, jnp.int32), jnp.ones((8, 24))
  args = loss_spec.canonicalize(x, labels, w, reduction="mean")
  plan = _plan("test_loss", args, P("data"), P("data"), P(None, "model"))
  assert plan.in_specs == (P(("data",), None), P(("data",)), P(None, ("model",)))
  assert plan.out_sums == ("model",) and plan.out_means == ("data",) and plan.mean_count == 4
  assert plan.grad_sums[0] == ("model",)  # x meets only its devices' columns


def test_a_label_over_two_mesh_axes_splits_over_their_product():
  """Rows over ("data", "model"): 8 shards, so a mean over them divides by 8; 12 rows (4
  divides them, 8 does not) stay whole."""
  x, labels, w = jnp.ones((16, 8)), jnp.zeros(16, jnp.int32), jnp.ones((8, 24))
  args = loss_spec.canonicalize(x, labels, w, reduction="mean")
  both = P(("data", "model"))
  plan = _plan("test_loss_two_axes", args, both, both, P())
  assert plan.in_specs == (P(("data", "model"), None), P(("data", "model")), P(None, None))
  assert plan.shards["b"].count == 8 and plan.mean_count == 8
  assert plan.out_means == ("data", "model") and plan.grad_sums[2] == ("data", "model")
  args = norm_spec.canonicalize(jnp.ones((12, 4)), jnp.ones(4), None)
  with pytest.warns(
    UserWarning, match=r"axis 0 \(r0\) of `x` is sharded over mesh axes \('data', 'model'\)"
  ):
    plan = _plan("test_norm_two_axes", args, both, P())
  assert not plan.splits and plan.in_specs == (P(None, None), P(None))


def _sdy_rule(args, spec_module):
  rule = spec_module.partitioning(args)
  shapes = [x.shape for x in jax.tree.leaves(args)]
  return partitioning._sdy_rule(rule.leaf_labels(args), shapes, [rule.output])


def test_shardy_rule_sizes_the_query_head_groups():
  """4 query heads over 2 kv heads: the query's head axis is (kv head, group), the group's
  size (2) given, the kv head's read from the key; 1 kv head: the group alone."""
  q, kv = jnp.ones((4, 8, 4, 16)), jnp.ones((4, 8, 2, 16))
  sdy = _sdy_rule(attention_spec.canonicalize(q, kv, kv), attention_spec)
  assert tuple(sdy.operand_mappings[0][2]) == ("k", "g") and sdy.operand_mappings[1][2] == "k"
  assert sdy.factor_sizes == {"g": 2}
  kv = jnp.ones((4, 8, 1, 16))
  sdy = _sdy_rule(attention_spec.canonicalize(q, kv, kv), attention_spec)
  assert sdy.operand_mappings[0][2] == "g" and sdy.factor_sizes == {}


def test_shardy_rule_gives_each_unsplit_axis_its_own_factor():
  """Axes that never split (here of sizes 3, 5 and 3) are unrelated factors."""
  labels = [("x", (None, "m")), ("y", (None,))]
  sdy = partitioning._sdy_rule(labels, [(3, 4), (5,)], [(None, "m")])
  unsplit = {sdy.operand_mappings[0][0], sdy.operand_mappings[1][0], sdy.result_mappings[0][0]}
  assert len(unsplit) == 3, sdy
  assert sdy.operand_mappings[0][1] == sdy.result_mappings[0][1] == "m"


def _in_shard_map(body, *specs, shapes=None):
  """Traces `body` inside `shard_map` over a 1x1 mesh of ("data", "model"), args by `specs`."""
  mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  args = [jnp.ones(shape) for shape in shapes or [(2,)] * len(specs)]
  jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P()))(*args)


def test_kernel_output_and_vary_type_outputs_by_every_input():
  """A kernel's output varies over the mesh axes of all its inputs, whichever comes last;
  `vary` adds the missing axes to an output already varying over some."""
  seen = {}

  def body(x, w):
    out = partitioning.kernel_output
    seen["x_w"] = out((2,), jnp.float32, x, w).manual_axis_type.varying
    seen["w_x"] = out((2,), jnp.float32, w, x).manual_axis_type.varying
    seen["vary"] = partitioning.vma(partitioning.vary(x, frozenset(("data", "model"))))
    return jax.lax.psum(x.sum() + w.sum(), ("data", "model"))

  _in_shard_map(body, P("data"), P("model"))
  assert seen == dict.fromkeys(("x_w", "w_x", "vary"), frozenset(("data", "model"))), seen


def test_record_vma_and_cotangents_of_integer_inputs():
  """A record varies over the mesh axes of any of its arrays; the cotangent of an integer
  input (float0) is passed on as it is, not typed or summed."""
  seen = {}

  def body(x, scale):
    seen["record"] = partitioning.record_vma(norm_spec.canonicalize(x, scale, None))
    zero = np.zeros((2,), jax.dtypes.float0)
    seen["float0"] = partitioning.cotangent(zero, frozenset(), frozenset(("data",)))
    return jax.lax.psum(x.sum() + scale.sum(), ("data", "model"))

  _in_shard_map(body, P("data"), P("model"), shapes=[(2, 4), (4,)])
  assert seen["record"] == frozenset(("data", "model"))
  assert seen["float0"].dtype == jax.dtypes.float0 and not partitioning.vma(seen["float0"])


def test_a_cotangent_varies_like_its_input():
  """A kernel's untyped cotangent of an input varying over "data", of inputs varying over
  ("data", "model"): typed as varying over both, then summed over "model" only, so that it
  varies over "data" like the input."""
  seen = {}

  def body(x, w):
    grad = jnp.full((2,), 3.0)  # Untyped: a kernel's output varies over nothing.
    both = frozenset(("data", "model"))
    seen["x"] = partitioning.cotangent(grad, partitioning.vma(x), both)
    seen["w"] = partitioning.cotangent(grad, frozenset(), both)
    return jax.lax.psum(x.sum() + w.sum(), ("data", "model"))

  _in_shard_map(body, P("data"), P("model"))
  assert partitioning.vma(seen["x"]) == frozenset(("data",))
  assert not partitioning.vma(seen["w"])


def test_a_split_label_keeps_the_mesh_axes_it_took_first():
  """Rows of `x` over "data" and of `labels` over "model": the rows stay on "data" (first
  come) and the labels are resharded there, not the rows moved to "model"."""
  x, labels, w = jnp.ones((16, 8)), jnp.zeros(16, jnp.int32), jnp.ones((8, 24))
  args = loss_spec.canonicalize(x, labels, w, reduction="mean")
  plan = _plan("test_loss_first_come", args, P("data"), P("model"), P())
  assert plan.in_specs == (P(("data",), None), P(("data",)), P(None, None))
  assert plan.shards == {"b": partitioning.Shard(("data",), 4)}
  assert plan.out_means == ("data",) and plan.mean_count == 4


@pytest.fixture(scope="module")
def results(request) -> dict[str, str | None]:
  """The checks of the selected cases, in one subprocess."""
  selected = [
    item.callspec.params["name"]
    for item in request.session.items
    if item.module is request.module and hasattr(item, "callspec")
  ]
  # The Mosaic GPU interpreter blocks XLA CPU threads in host callbacks (each device's
  # program, and each CTA's warpgroups): a pool of one thread per core deadlocks.
  env = dict(
    os.environ,
    XLA_FLAGS="--xla_force_host_platform_device_count=8",
    JAX_PLATFORMS="cpu",
    PJRT_NPROC="64",
  )
  root = Path(__file__).resolve().parents[2]
  # This tree's tokamax, not an installed one (an editable install of another checkout).
  env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(root), env.get("PYTHONPATH", "")])
  run = subprocess.run(
    [sys.executable, "-m", "suites.core.kernel_sharding_checks", *selected],
    cwd=root,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
  if not lines:
    pytest.fail(run.stdout[-3000:] + run.stderr[-3000:])
  return {line["case"]: line["error"] for line in lines}


_OPS = {"attention": "dot_product_attention", "loss": "linear_softmax_cross_entropy_loss"}


def _param(name: str):
  """The case, counted in the summary under its op and implementation."""
  op, impl, _ = name.split("/")
  marks = [pytest.mark.op(_OPS.get(op, op), impl)]
  if name in kernel_sharding_checks.KNOWN_FAILURES:
    marks.append(pytest.mark.xfail(reason=kernel_sharding_checks.KNOWN_FAILURES[name], strict=True))
  return pytest.param(name, marks=marks)


@pytest.mark.parametrize("name", [_param(n) for n in NAMES])
def test_sharded_call_matches_whole_without_gathering(name, results):
  assert name in results, "the checks stopped before this case"
  assert results[name] is None, results[name]


def test_a_split_label_the_output_lacks_needs_its_combine():
  """A `combine` mapping that does not name a split label missing from the output: an
  error, not a silent sum."""
  labels = [("x", ("m", "k"))]

  def plan(combine):
    rule = partitioning.Rule(
      inputs={"x": ("m", "k")}, output=("k",), split=frozenset(("m",)), combine=combine
    )
    return partitioning.plan("test_combine", rule, labels, [(8, 4)], [P("data")], MESH)

  with pytest.raises(ValueError, match=r"lacks split label 'm'.*got None"):
    plan({"v": "sum"})
  with pytest.raises(ValueError, match=r"lacks split label 'm'.*got 'max'"):
    plan("max")  # Neither a sum nor a mean.
  assert plan({"m": "mean"}).out_means == ("data",)
  assert plan({"m": "sum"}).out_sums == ("data",)
