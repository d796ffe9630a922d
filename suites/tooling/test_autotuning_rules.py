"""The autotuner's rules, on the example user op (small, fast to compile) and fake timers.

The median of a candidate's runs decides (not the mean: one slow outlier run
does not lose it the race); "forward_and_vjp" really times the backward pass;
fixed configs, time budgets and failures follow `tokamax.autotune`'s contract;
results keep their library version and reject unknown format versions; configs
encode canonically; timing inputs are valid; signature keys tell static
arguments apart.
"""

import dataclasses
import enum
import functools
import json
import pathlib
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax._src import arguments
from tokamax._src.autotuning import api, autotuner, cache, configs, inputs
from tokamax._src.autotuning import example_user_op as ex
from tokamax._src.ops.attention import spec as attention_spec
from tokamax._src.ops.ragged_dot import spec as ragged_dot_spec


def _x(n: int = 64):
  return jax.random.normal(jax.random.key(0), (8, n), jnp.float32)


def _block(text: str) -> int:
  return json.loads(text)["block_cols"]


def _tuned(monkeypatch, runs_ms, blocks):
  """Autotunes BlockedRowRms over `blocks` with canned run times (timed in text order)."""
  canned = iter(runs_ms)
  monkeypatch.setattr(autotuner.benchmarking, "time_compiled", lambda *a, **k: next(canned))
  candidates = [ex.BlockConfig(b) for b in blocks]
  return ex.BlockedRowRms().bind(_x()).autotune(candidates=candidates, iterations=3)


def test_the_median_run_decides(monkeypatch):
  """Block 16: runs of 1, 1 and 100 ms (median 1, mean 34); block 32: 5, 5, 5 ms."""
  data = _tuned(monkeypatch, [[1.0, 1.0, 100.0], [5.0, 5.0, 5.0]], (32, 16))
  assert [(_block(c), t) for c, t in data.timings_ms] == [(16, 1.0), (32, 5.0)]
  assert _block(data.config) == 16


def test_the_fastest_candidate_wins_whatever_its_config_text(monkeypatch):
  """Block 16 (first in text order) runs in 5 ms, block 32 in 1 ms: 32 wins, listed first."""
  data = _tuned(monkeypatch, [[5.0, 5.0, 5.0], [1.0, 1.0, 1.0]], (16, 32))
  assert [(_block(c), t) for c, t in data.timings_ms] == [(32, 1.0), (16, 5.0)]
  assert _block(data.config) == 32


def test_find_ops_reports_each_signature_of_an_op():
  """One op called at two shapes (and again at the first): two calls to tune, in order."""

  def f(x, y):
    rms = lambda a: ex.row_rms(a, implementation="blocked").sum()
    return rms(x) + rms(y) + rms(2 * x)

  found = api.find_ops(f, _x(64), _x(32))
  assert [(b.op.name, mode) for b, mode in found] == [("blocked", "forward")] * 2
  assert [b.args.x.shape for b, _ in found] == [(8, 64), (8, 32)]


def test_find_ops_passes_leaves_that_are_not_arrays_as_they_are():
  """A scale (a Python float) and a name (a string) reach `f` unchanged; the array is traced."""
  seen = []

  def f(x, scale, name):
    seen.append((isinstance(x, jax.core.Tracer), scale, name))
    return ex.row_rms(x * scale, implementation="blocked")

  found = api.find_ops(f, _x(64), 2.0, "rows")
  assert seen == [(True, 2.0, "rows")]
  assert [(b.op.name, b.args.x.shape) for b, _ in found] == [("blocked", (8, 64))]


@jax.custom_vjp
def _no_backward(x):
  return x


def _no_backward_fwd(x):
  return x, None


def _no_backward_bwd(res, g):
  raise ValueError("this candidate has no backward pass")


_no_backward.defvjp(_no_backward_fwd, _no_backward_bwd)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _BrokenBackwardRowRms(ex.BlockedRowRms):
  """Block 16 has a forward pass but no backward pass."""

  def _fwd(self, args, config):
    if config.block_cols == 16:
      args = dataclasses.replace(args, x=_no_backward(args.x))
    return super()._fwd(args, config)


@pytest.mark.parametrize("mode", ["forward", "forward_and_vjp"])
def test_forward_and_vjp_times_the_backward_pass(mode):
  data = (
    _BrokenBackwardRowRms()
    .bind(_x())
    .autotune(candidates=[ex.BlockConfig(16), ex.BlockConfig(32)], iterations=1, mode=mode)
  )
  assert data.mode == mode
  timed = {_block(c) for c, _ in data.timings_ms}
  if mode == "forward":
    assert timed == {16, 32} and not data.errors
  else:  # Block 16 fails where its backward pass is compiled.
    assert timed == {32} and _block(data.config) == 32
    ((config, error),) = data.errors
    assert _block(config) == 16 and "no backward pass" in error


def test_a_fixed_config_is_not_tuned():
  fixed = ex.BlockedRowRms(config=ex.BlockConfig(32))
  result = tokamax.autotune(lambda x: ex.row_rms(x, implementation=fixed), _x(), progress=False)
  assert len(result) == 0
  free = tokamax.autotune(
    lambda x: ex.row_rms(x, implementation="blocked"), _x(), iterations=1, progress=False
  )
  assert len(free) == 1


def test_a_spent_time_budget_skips_the_ops_left():
  f = lambda x: ex.row_rms(x, implementation="blocked")
  result = tokamax.autotune(f, _x(), time_budget_s=0.0, ignore_cache=True, progress=False)
  (data,) = result.data
  assert data.config is None and data.errors == ((None, "skipped: time budget"),)
  assert not data.timings_ms


@dataclasses.dataclass(frozen=True, kw_only=True)
class _EveryCandidateFails(ex.BlockedRowRms):
  """The heuristics' block (64 here) works; the tuned candidates 16 and 32 do not."""

  def _fwd(self, args, config):
    if config.block_cols in (16, 32):
      raise ValueError(f"block {config.block_cols} is broken")
    return super()._fwd(args, config)

  def _get_autotuning_configs(self, args):
    return {ex.BlockConfig(16), ex.BlockConfig(32)}


def test_every_candidate_failing_raises_unless_errors_are_ignored():
  op = _EveryCandidateFails()
  f = lambda x: ex.row_rms(x, implementation=op)
  result = tokamax.autotune(f, _x(), iterations=1, progress=False)
  (data,) = result.data
  assert data.config is None and {_block(c) for c, _ in data.errors} == {16, 32}
  with pytest.raises(RuntimeError, match="every candidate failed"):
    tokamax.autotune(f, _x(), iterations=1, ignore_errors=False, progress=False)


def test_only_the_two_tuning_modes_are_accepted():
  """The benchmarking mode "vjp" (the backward pass alone) is not a tuning mode."""
  with pytest.raises(ValueError, match="`mode` must be 'forward' or 'forward_and_vjp'"):
    ex.BlockedRowRms().bind(_x()).autotune(mode="vjp", iterations=1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _NoCandidates(ex.BlockedRowRms):
  """Listing the candidates fails."""

  def _get_autotuning_configs(self, args):
    raise ValueError("no candidates here")


def test_an_op_whose_candidates_fail_is_recorded_unless_errors_raise():
  f = lambda x: ex.row_rms(x, implementation=_NoCandidates())
  result = tokamax.autotune(f, _x(), progress=False)
  (data,) = result.data
  assert (data.implementation, data.config, data.timings_ms) == ("blocked", None, ())
  assert data.errors == ((None, "candidates: ValueError: no candidates here"),)
  with pytest.raises(ValueError, match="no candidates here"):
    tokamax.autotune(f, _x(), ignore_errors=False, progress=False)


# -- Results ------------------------------------------------------------------------


def _entry(**kw):
  fields = dict(op="example_row_rms", implementation="blocked", key="k", mode="forward")
  fields.update(config='{"block_cols":16}', heuristic='{"block_cols":64}')
  fields.update(kw)
  return api.AutotuningData(**fields)


def test_a_loaded_result_keeps_the_version_that_tuned_it():
  old = tokamax.AutotuningResult("cpu", (_entry(),), library_version="0.0.1")
  again = tokamax.AutotuningResult.loads(old.dumps())
  assert again.library_version == "0.0.1" != tokamax.__version__
  assert again == old and json.loads(again.dumps())["library_version"] == "0.0.1"


@pytest.mark.parametrize("version", [0, 2, None])
def test_other_format_versions_are_rejected(version):
  obj = json.loads(tokamax.AutotuningResult("cpu", (_entry(),)).dumps())
  obj["format_version"] = version
  with pytest.raises(ValueError, match="format_version"):
    tokamax.AutotuningResult.from_json(obj)


def test_dumped_json_has_its_keys_sorted_in_every_object():
  """`dumps` is stable text: every object's keys in sorted order, the top level's included."""
  entry = _entry(timings_ms=(('{"block_cols":16}', 1.0),), errors=(('{"block_cols":8}', "x"),))
  orders = []

  def record(pairs):
    orders.append([k for k, _ in pairs])
    return dict(pairs)

  json.loads(tokamax.AutotuningResult("cpu", (entry,)).dumps(), object_pairs_hook=record)
  assert ["data", "device_kind", "format", "format_version", "library_version"] in orders
  assert len(orders) >= 5
  assert all(keys == sorted(keys) for keys in orders), orders


def test_a_later_entry_of_the_same_key_wins():
  a, b = _entry(config='{"block_cols":16}'), _entry(config='{"block_cols":32}')
  assert tokamax.AutotuningResult("cpu", (a, b)).data == (b,)
  assert tokamax.AutotuningResult("cpu", (b, a)).data == (a,)


def test_results_of_another_device_kind_or_version_differ():
  """The same entries tuned on another device kind (or by another version) are another result."""
  entries = (_entry(),)
  base = tokamax.AutotuningResult("cpu", entries, library_version="1.0")
  assert base == tokamax.AutotuningResult("cpu", entries, library_version="1.0")
  assert base != tokamax.AutotuningResult("TPU v5 lite", entries, library_version="1.0")
  assert base != tokamax.AutotuningResult("cpu", entries, library_version="0.9")


# -- Configs ------------------------------------------------------------------------


class _Order(enum.Enum):
  ROW_MAJOR = "row"
  COLUMN_MAJOR = "column"


@dataclasses.dataclass(frozen=True)
class _Inner:
  stages: int = 2


@dataclasses.dataclass(frozen=True)
class _Config:
  """Fields out of alphabetical order, an enum, a tuple, a nested config, an optional."""

  zeta: int = 1
  alpha: tuple[int, int] = (64, 32)
  order: _Order = _Order.ROW_MAJOR
  inner: _Inner = _Inner()
  split: int | None = None


def test_configs_encode_canonically():
  text = configs.encode(_Config(zeta=3, order=_Order.COLUMN_MAJOR))
  assert text == ('{"alpha":[64,32],"inner":{"stages":2},"order":"column","split":null,"zeta":3}')
  # The text is the same whatever the key order of the JSON it came from.
  assert configs.canonical(json.loads(text)) == text
  shuffled = {
    "zeta": 3,
    "split": None,
    "order": "column",
    "inner": {"stages": 2},
    "alpha": [64, 32],
  }
  assert configs.canonical(shuffled) == text


def test_configs_decode_to_their_class():
  config = _Config(zeta=3, alpha=(128, 16), order=_Order.COLUMN_MAJOR, inner=_Inner(4), split=2)
  again = configs.decode(_Config, configs.encode(config))
  assert again == config and hash(again) == hash(config)
  assert isinstance(again.alpha, tuple) and isinstance(again.order, _Order)
  assert isinstance(again.inner, _Inner)
  with pytest.raises(ValueError, match="no fields"):
    configs.decode(_Config, '{"zeta":1,"block_q":64}')


@dataclasses.dataclass(frozen=True)
class _FixedTuplesConfig:
  """Fixed-length tuples: each position decodes by its own type."""

  pair: tuple[int, _Order] = (8, _Order.ROW_MAJOR)
  single: tuple[_Inner] = (_Inner(),)


def test_fixed_length_tuple_fields_decode_each_position_by_its_type():
  text = '{"pair":[16,"column"],"single":[{"stages":3}]}'
  again = configs.decode(_FixedTuplesConfig, text)
  assert again.pair == (16, _Order.COLUMN_MAJOR) and isinstance(again.pair[1], _Order)
  assert again.single == (_Inner(3),) and isinstance(again.single[0], _Inner)


@dataclasses.dataclass(frozen=True)
class _OptionalConfig:
  """Optional enums and nested configs (`X | None`), and a float: JSON scalars too."""

  order: _Order | None = None
  inner: _Inner | None = None
  ratio: float = 0.5


def test_configs_of_optional_enums_nested_configs_and_floats_round_trip():
  config = _OptionalConfig(order=_Order.COLUMN_MAJOR, inner=_Inner(3), ratio=0.25)
  text = configs.encode(config)
  assert text == '{"inner":{"stages":3},"order":"column","ratio":0.25}'
  again = configs.decode(_OptionalConfig, text)
  assert again == config and hash(again) == hash(config)
  assert isinstance(again.order, _Order) and isinstance(again.inner, _Inner)
  assert configs.decode(_OptionalConfig, configs.encode(_OptionalConfig())) == _OptionalConfig()


def test_configs_of_numpy_scalars_encode_as_plain_numbers():
  """Heuristics computed with NumPy give NumPy scalars: they encode as the plain numbers."""
  config = _Config(zeta=np.int64(3), alpha=(np.int32(64), 32), split=np.int64(2))
  text = configs.encode(config)
  assert text == '{"alpha":[64,32],"inner":{"stages":2},"order":"row","split":2,"zeta":3}'
  assert configs.decode(_Config, text) == _Config(zeta=3, alpha=(64, 32), split=2)


# -- Timing inputs and keys -----------------------------------------------------------


def test_timing_inputs_hold_valid_integer_values():
  q = jax.ShapeDtypeStruct((2, 96, 4, 16), jnp.float32)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  record = jax.eval_shape(
    lambda q, lengths: attention_spec.SPEC.canonicalize(
      q, q, q, query_seq_lengths=lengths, key_value_seq_lengths=lengths
    ),
    q,
    lengths,
  )
  filled = inputs.fill_integer_fields(record, attention_spec.SPEC)
  # Every sequence at its full length (zero lengths would time a fully masked call).
  np.testing.assert_array_equal(filled.q_seq_lengths, [96, 96])
  np.testing.assert_array_equal(filled.kv_seq_lengths, [96, 96])
  assert filled.q_seq_lengths.dtype == np.int32
  assert isinstance(filled.query, jax.ShapeDtypeStruct)  # Floats stay abstract.

  lhs, rhs = (
    jax.ShapeDtypeStruct((100, 16), jnp.float32),
    jax.ShapeDtypeStruct((4, 16, 8), jnp.float32),
  )
  sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
  record = jax.eval_shape(ragged_dot_spec.SPEC.canonicalize, lhs, rhs, sizes)
  filled = inputs.fill_integer_fields(record, ragged_dot_spec.SPEC, seed=3)
  assert filled.group_sizes.dtype == np.int32 and filled.group_sizes.shape == (4,)
  assert filled.group_sizes.sum() == 100 and (filled.group_sizes >= 0).all()


def test_integer_inputs_follow_the_seed():
  """Random group sizes of ragged_dot: one seed gives the same sizes, another other sizes."""
  lhs = jax.ShapeDtypeStruct((1000, 16), jnp.float32)
  rhs = jax.ShapeDtypeStruct((8, 16, 8), jnp.float32)
  sizes = jax.ShapeDtypeStruct((8,), jnp.int32)
  record = jax.eval_shape(ragged_dot_spec.SPEC.canonicalize, lhs, rhs, sizes)

  def group_sizes(seed):
    filled = inputs.fill_integer_fields(record, ragged_dot_spec.SPEC, seed=seed)
    assert filled.group_sizes.sum() == 1000
    return np.asarray(filled.group_sizes)

  np.testing.assert_array_equal(group_sizes(0), group_sizes(0))
  assert not np.array_equal(group_sizes(0), group_sizes(1))


def test_signature_keys_tell_static_arguments_apart():
  q = jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.float32)

  def key(**kwargs):
    return arguments.signature_key(
      jax.eval_shape(lambda q: attention_spec.SPEC.canonicalize(q, q, q, **kwargs), q)
    )

  plain = key()
  assert plain == key()
  assert plain != key(is_causal=True)  # A config tuned without the mask is not for it.
  assert plain != key(local_window_size=(8, 8))
  assert plain != key(logits_soft_cap=30.0)
  assert "is_causal=True" in key(is_causal=True)


@pytest.mark.parametrize(
  ("kind", "name"),
  [
    ("NVIDIA H200", "NVIDIA_H200.json"),
    ("NVIDIA A100-SXM4-80GB", "NVIDIA_A100-SXM4-80GB.json"),
    ("NVIDIA H100 80GB HBM3", "NVIDIA_H100_80GB_HBM3.json"),
    ("TPU v5 lite", "TPU_v5_lite.json"),
    ("TPU v5p (2x)", "TPU_v5p_2x.json"),
  ],
)
def test_default_cache_file_names(kind, name):
  assert cache.file_name(kind) == name


@dataclasses.dataclass(frozen=True, kw_only=True)
class _OneCandidate(ex.BlockedRowRms):
  def _get_autotuning_configs(self, args):
    return {ex.BlockConfig(32)}


def test_a_single_candidate_is_nothing_to_tune_on_a_miss():
  x = _x()
  with tokamax.config.override(cache_miss="error"):
    out = jax.jit(lambda x: ex.row_rms(x, implementation=_OneCandidate()))(x)  # No lookup error.
    with pytest.raises(LookupError, match="no tuned config"):
      jax.jit(lambda x: ex.row_rms(x, implementation="blocked"))(x)
  x64 = np.asarray(x, np.float64)
  np.testing.assert_allclose(np.asarray(out), np.sqrt((x64 * x64).mean(-1)), rtol=1e-5)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _TwoCandidates(ex.BlockedRowRms):
  def _get_autotuning_configs(self, args):
    return {ex.BlockConfig(16), ex.BlockConfig(32)}


def test_two_candidates_are_something_to_tune_on_a_miss():
  """Only a single candidate skips the miss: with two, cache_miss="error" raises."""
  cache.clear_tuned_on_miss()
  with (
    tokamax.config.override(cache_miss="error"),
    pytest.raises(LookupError, match="no tuned config"),
  ):
    cache.lookup(_TwoCandidates(), _record())


@pytest.mark.parametrize(
  ("config", "expected"),
  [
    ({"block_cols": 16}, 16),  # Current: used.
    ({"block_cols": 16, "unroll": 2}, None),  # A field today's config lacks: a newer kernel's.
    ({}, None),  # Every field missing: an older kernel's.
  ],
)
def test_shipped_entries_must_match_todays_config_fields(monkeypatch, config, expected):
  op = ex.BlockedRowRms()
  record = arguments.abstract(ex.SPEC.canonicalize(_x()))
  heuristic = configs.encode(op._get_heuristics_config(record))
  entry = _entry(key=arguments.signature_key(record), config=configs.canonical(config))
  entry = dataclasses.replace(entry, heuristic=heuristic)
  monkeypatch.setattr(
    cache, "default_result", lambda kind: tokamax.AutotuningResult(kind, (entry,))
  )
  found = cache.lookup(op, record)  # No error: a stale entry falls back to the heuristics.
  assert (None if found is None else found.block_cols) == expected


@arguments.op_arguments
class _IdsRecord:
  x: jax.Array
  ids: jax.Array
  count: int = arguments.static()


def test_timing_inputs_keep_the_records_integer_dtypes():
  """Integer fields the spec does not fill are zeros of the field's own dtype and shape."""
  record = _IdsRecord(
    x=jax.ShapeDtypeStruct((4,), jnp.float32), ids=jax.ShapeDtypeStruct((3, 2), jnp.int8), count=2
  )
  filled = inputs.fill_integer_fields(record, types.SimpleNamespace(integer_inputs={}))
  assert filled.ids.dtype == np.int8 and filled.ids.shape == (3, 2) and not filled.ids.any()
  assert filled.x == record.x and filled.count == 2


# -- Where configs come from ----------------------------------------------------------


def _record():
  return arguments.abstract(ex.SPEC.canonicalize(_x()))


def _current_entry(block_cols: int | None, **kw):
  """An entry of the blocked row RMS for `_x()` that is current (today's heuristic)."""
  record = _record()
  heuristic = configs.encode(ex.BlockedRowRms()._get_heuristics_config(record))
  config = None if block_cols is None else configs.encode(ex.BlockConfig(block_cols))
  return _entry(key=arguments.signature_key(record), config=config, heuristic=heuristic, **kw)


def test_an_entered_result_outranks_a_config_tuned_on_a_miss():
  op, record = ex.BlockedRowRms(), _record()
  kind = cache.device_kind()
  tuned = dataclasses.replace(_current_entry(16), config_cls=ex.BlockConfig)
  cache.clear_tuned_on_miss()
  cache._TUNED_ON_MISS[(kind, "example_row_rms", "blocked", tuned.key)] = tuned
  try:
    assert cache.lookup(op, record) == ex.BlockConfig(16)
    with tokamax.AutotuningResult(kind, (_current_entry(32),)):
      assert cache.lookup(op, record) == ex.BlockConfig(32)
  finally:
    cache.clear_tuned_on_miss()


def test_a_miss_is_tuned_once_per_signature(monkeypatch):
  calls = []

  def fake_autotune_call(op, args, **kwargs):
    calls.append(arguments.signature_key(args))
    return dataclasses.replace(_current_entry(16), config_cls=ex.BlockConfig)

  monkeypatch.setattr(cache.autotuner, "autotune_call", fake_autotune_call)
  op, record = ex.BlockedRowRms(), _record()
  cache.clear_tuned_on_miss()
  try:
    with tokamax.config.override(cache_miss="autotune"):
      assert cache.lookup(op, record) == ex.BlockConfig(16)
      assert cache.lookup(op, record) == ex.BlockConfig(16)  # Found, not tuned again.
  finally:
    cache.clear_tuned_on_miss()
  assert calls == [arguments.signature_key(record)]


def test_a_shipped_file_of_another_device_kind_is_not_used(monkeypatch, tmp_path):
  """Two device kinds whose names map to one file name: the file's own kind decides."""
  assert cache.file_name("TPU v5p (2x)") == cache.file_name("TPU v5p 2x")
  tokamax.AutotuningResult("TPU v5p (2x)", (_current_entry(16),)).dump(
    tmp_path / cache.file_name("TPU v5p (2x)")
  )
  monkeypatch.setattr(cache, "DATA_DIR", tmp_path)
  cache.default_result.cache_clear()
  op, record = ex.BlockedRowRms(), _record()
  key = arguments.signature_key(record)
  try:
    found = cache.lookup_data(op, key, "TPU v5p (2x)", record)
    assert found is not None and found.fastest_config == ex.BlockConfig(16)
    assert cache.lookup_data(op, key, "TPU v5p 2x", record) is None
  finally:
    cache.default_result.cache_clear()


def _failed_entry_that_must_not_retune(monkeypatch):
  """An entry whose every candidate failed; tuning again raises."""

  def no_tuning(*args, **kwargs):
    raise AssertionError("tuned again")

  monkeypatch.setattr(cache.autotuner, "autotune_call", no_tuning)
  return _current_entry(None, errors=((None, "ValueError: broken"),))


@pytest.mark.parametrize("miss", ["error", "autotune"])
def test_an_entry_whose_every_candidate_failed_means_heuristics(monkeypatch, miss):
  """A covered call is not a miss: no lookup error, no tuning again."""
  failed = _failed_entry_that_must_not_retune(monkeypatch)
  op, record = ex.BlockedRowRms(), _record()
  result = tokamax.AutotuningResult(cache.device_kind(), (failed,))
  with result, tokamax.config.override(cache_miss=miss):
    assert cache.lookup(op, record) is None
    assert op.resolve_config(record) == ex.BlockConfig(64)  # The heuristics' (N = 64).


def test_a_fixed_config_is_kept_inside_an_entered_result():
  record = _record()
  with tokamax.AutotuningResult(cache.device_kind(), (_current_entry(16),)):
    assert ex.BlockedRowRms().resolve_config(record) == ex.BlockConfig(16)
    fixed = ex.BlockedRowRms(config=ex.BlockConfig(32))
    assert fixed.resolve_config(record) == ex.BlockConfig(32)


def test_results_of_the_same_entries_in_any_order_are_equal():
  a, b, c = (
    _entry(key=k, config=f'{{"block_cols":{n}}}') for k, n in (("a", 16), ("b", 32), ("c", 8))
  )
  one, other = (
    tokamax.AutotuningResult("cpu", (a, b, c)),
    tokamax.AutotuningResult("cpu", (c, a, b)),
  )
  assert [d.key for d in one.data] == [d.key for d in other.data] == ["a", "b", "c"]
  assert one == other and hash(one) == hash(other) and one.dumps() == other.dumps()
  ab, ca = tokamax.AutotuningResult("cpu", (a, b)), tokamax.AutotuningResult("cpu", (c,))
  assert ab.merge(ca) == ca.merge(ab) == one


def test_a_result_gives_no_config_of_another_implementation():
  """An entry of the op's "xla" implementation does not configure "blocked" for the call."""
  record = _record()
  key = arguments.signature_key(record)
  other = _current_entry(16, implementation="xla")
  result = tokamax.AutotuningResult(cache.device_kind(), (other,))
  assert result.data_for(ex.XlaRowRms(), key) is not None
  assert result.data_for(ex.BlockedRowRms(), key) is None
  with result:
    assert ex.BlockedRowRms().resolve_config(record) == ex.BlockConfig(64)  # Heuristics.


def test_autotune_tunes_again_an_op_whose_cached_entry_failed():
  failed = _current_entry(None, errors=((None, "ValueError: broken"),))
  f = lambda x: ex.row_rms(x, implementation="blocked")
  with tokamax.AutotuningResult(cache.device_kind(), (failed,)):
    result = tokamax.autotune(f, _x(), iterations=1, progress=False)
  (data,) = result.data
  assert data.config is not None and not data.errors
  assert {_block(c) for c, _ in data.timings_ms} == {16, 32, 64}


def test_a_current_shipped_entry_is_not_tuned_again(monkeypatch):
  """autotune takes a current entry of the shipped cache as it is, without timing."""

  def no_tuning(*args, **kwargs):
    raise AssertionError("tuned again")

  monkeypatch.setattr(api.autotuner, "autotune_call", no_tuning)
  shipped = _current_entry(16)
  monkeypatch.setattr(
    cache, "default_result", lambda kind: tokamax.AutotuningResult(kind, (shipped,))
  )
  f = lambda x: ex.row_rms(x, implementation="blocked")
  with tokamax.config.override(use_default_cache=True):
    result = tokamax.autotune(f, _x(), progress=False)
  (data,) = result.data
  assert (data.key, data.config) == (shipped.key, configs.encode(ex.BlockConfig(16)))


@pytest.mark.parametrize("miss", ["error", "autotune"])
def test_a_shipped_entry_whose_every_candidate_failed_means_heuristics(monkeypatch, miss):
  """As for an entered result: the call is covered, its heuristics run (no error, no tuning)."""
  failed = _failed_entry_that_must_not_retune(monkeypatch)
  monkeypatch.setattr(
    cache, "default_result", lambda kind: tokamax.AutotuningResult(kind, (failed,))
  )
  op, record = ex.BlockedRowRms(), _record()
  with tokamax.config.override(cache_miss=miss, use_default_cache=True):
    assert cache.lookup(op, record) is None
    assert op.resolve_config(record) == ex.BlockConfig(64)  # The heuristics' (N = 64).


def test_merging_results_of_one_older_version_keeps_that_version():
  """Results tuned by 0.0.1 merge into a 0.0.1 result, not one claiming this version tuned it;
  parts of two versions get this version."""
  a = tokamax.AutotuningResult("cpu", (_entry(key="a"),), library_version="0.0.1")
  b = tokamax.AutotuningResult("cpu", (_entry(key="b"),), library_version="0.0.1")
  assert tokamax.__version__ != "0.0.1"
  assert a.merge(b).library_version == "0.0.1"
  assert (a | b).library_version == "0.0.1"
  assert a.merge().library_version == "0.0.1"
  newer = tokamax.AutotuningResult("cpu", (_entry(key="c"),), library_version="0.0.2")
  assert a.merge(b, newer).library_version == tokamax.__version__


# -- Hunt: the autotuner's arguments, results' keys and JSON, where configs come from ----------


def test_the_median_not_the_fastest_run_decides(monkeypatch):
  """Block 16: runs of 1, 9 and 9 ms (fastest 1, median 9); block 32: 5, 5, 5 ms: 32 wins."""
  data = _tuned(monkeypatch, [[1.0, 9.0, 9.0], [5.0, 5.0, 5.0]], (16, 32))
  assert [(_block(c), t) for c, t in data.timings_ms] == [(32, 5.0), (16, 9.0)]
  assert _block(data.config) == 32


def test_the_autotuner_times_with_the_iterations_method_and_seed_asked_for(monkeypatch):
  calls = []

  def fake_time_compiled(compiled, args, *, iterations, method):
    calls.append((iterations, method, [np.asarray(a) for a in jax.tree.leaves(args)]))
    return [1.0] * iterations

  monkeypatch.setattr(autotuner.benchmarking, "time_compiled", fake_time_compiled)
  bound = ex.BlockedRowRms().bind(_x())
  candidates = [ex.BlockConfig(16), ex.BlockConfig(32)]
  bound.autotune(candidates=candidates, iterations=7, method="wallclock", seed=3)
  assert [(i, m) for i, m, _ in calls] == [(7, "wallclock")] * 2
  seed3 = calls[0][2]
  calls.clear()
  bound.autotune(candidates=candidates, iterations=2, seed=0)
  assert [(i, m) for i, m, _ in calls] == [(2, None)] * 2
  seed0 = calls[0][2]
  assert len(seed3) == len(seed0) >= 1
  assert any(not np.array_equal(a, b) for a, b in zip(seed3, seed0, strict=True))


def test_a_candidate_error_keeps_the_first_line_of_its_message():
  error = ValueError("block 24 is broken\n  at line 3 of the kernel")
  assert autotuner._short_error(error) == "ValueError: block 24 is broken"


def test_a_tuned_entry_records_the_heuristics_choice_not_the_winner(monkeypatch):
  """The heuristics pick 64 columns for N = 64; block 16 wins the race."""
  data = _tuned(monkeypatch, [[1.0, 1.0, 1.0], [5.0, 5.0, 5.0]], (16, 32))
  assert data.config == '{"block_cols":16}'
  assert data.heuristic == '{"block_cols":64}'


def test_merge_checks_the_device_kind_of_every_result():
  a, b = tokamax.AutotuningResult("cpu", (_entry(key="a"),)), tokamax.AutotuningResult("cpu")
  tpu = tokamax.AutotuningResult("TPU v5 lite", (_entry(key="c"),))
  with pytest.raises(ValueError, match="device kinds"):
    a.merge(b, tpu)


def test_entries_of_two_implementations_at_one_key_are_both_kept():
  xla = _entry(implementation="xla", config=None)
  blocked = _entry(implementation="blocked", config='{"block_cols":32}')
  result = tokamax.AutotuningResult("cpu", (blocked, xla))
  assert [(d.implementation, d.config) for d in result.data] == [
    ("blocked", '{"block_cols":32}'),
    ("xla", None),
  ]
  assert result.data_for(ex.BlockedRowRms(), "k").fastest_config == ex.BlockConfig(32)


def test_dumped_entries_keep_their_mode_and_heuristic():
  entry = _entry(mode="forward_and_vjp", heuristic='{"block_cols":64}')
  (dumped,) = json.loads(tokamax.AutotuningResult("cpu", (entry,)).dumps())["data"]
  assert dumped["mode"] == "forward_and_vjp"
  assert dumped["heuristic"] == {"block_cols": 64}


def test_json_without_the_format_name_is_rejected():
  obj = json.loads(tokamax.AutotuningResult("cpu", (_entry(),)).dumps())
  del obj["format"]
  with pytest.raises(ValueError, match="not an autotuning result"):
    tokamax.AutotuningResult.from_json(obj)


def test_a_shipped_entry_is_not_taken_without_arguments_to_check_it(monkeypatch):
  """Staleness depends on the arguments: a lookup by key alone gets no shipped entry."""
  shipped = _current_entry(16)
  monkeypatch.setattr(
    cache, "default_result", lambda kind: tokamax.AutotuningResult(kind, (shipped,))
  )
  op, record = ex.BlockedRowRms(), _record()
  key, kind = arguments.signature_key(record), cache.device_kind()
  with tokamax.config.override(use_default_cache=True):
    assert cache.lookup_data(op, key, kind, record).fastest_config == ex.BlockConfig(16)
    assert cache.lookup_data(op, key, kind) is None


def test_bound_default_config_is_the_one_a_call_would_use():
  bound = ex.BlockedRowRms().bind(_x())
  assert bound.default_config == ex.BlockConfig(64)  # The heuristics' (N = 64).
  with tokamax.AutotuningResult(cache.device_kind(), (_current_entry(16),)):
    assert bound.default_config == ex.BlockConfig(16)
    fixed = ex.BlockedRowRms(config=ex.BlockConfig(32)).bind(_x())
    assert fixed.default_config == ex.BlockConfig(32)


def test_config_for_gives_the_decoded_config_of_a_bound_call():
  bound = ex.BlockedRowRms().bind(_x())
  result = tokamax.AutotuningResult(cache.device_kind(), (_current_entry(16),))
  assert result.config_for(bound) == ex.BlockConfig(16)
  assert result.config_for(ex.XlaRowRms().bind(_x())) is None


def test_dumping_to_a_path_replaces_what_was_there(tmp_path):
  path = tmp_path / "result.json"
  tokamax.AutotuningResult("cpu", (_entry(key="old"),)).dump(path)
  tokamax.AutotuningResult("cpu", (_entry(key="new"),)).dump(str(path))
  assert [d.key for d in tokamax.AutotuningResult.load(path).data] == ["new"]


def _compile_candidates(n, seconds, name):
  """`n` distinct functions (no shared trace cache) that each trace for `seconds`."""

  def make(i):
    def fn(x):
      name.append(threading.current_thread().name)
      time.sleep(seconds[i])
      return x + i

    return fn

  arg = jax.ShapeDtypeStruct((4,), jnp.float32)
  return [(make(i), arg) for i in range(n)]


@pytest.mark.parametrize("max_workers", [1, 2])
def test_candidates_compile_on_at_most_max_workers_threads(max_workers):
  """Four candidates tracing for 0.2 s each: a pool of its own size would use four threads."""
  threads = []
  candidates = _compile_candidates(4, [0.2] * 4, threads)
  bar = autotuner.Progress(False, 4)
  compiled, errors = autotuner._compile_all(candidates, 60.0, max_workers, bar)
  assert sorted(compiled) == [0, 1, 2, 3] and not errors
  assert len(threads) == 4
  assert len(set(threads)) <= max_workers
  assert bar.done == 4


def test_a_queued_candidate_is_timed_from_its_own_start():
  """One thread, eight candidates of 0.3 s each and a 1.5 s timeout: none times out.

  The last three wait 1.5-2.1 s in the queue; only their own compile time counts (0.3 s and
  XLA's, with over a second to spare on a loaded machine).
  """
  candidates = _compile_candidates(8, [0.3] * 8, [])
  bar = autotuner.Progress(False, 8)
  compiled, errors = autotuner._compile_all(candidates, 1.5, 1, bar)
  assert errors == {}
  assert sorted(compiled) == list(range(8))


def test_a_timed_out_candidate_advances_the_progress_once():
  """Candidate 1 traces for 4 s against a 1.5 s timeout; candidate 0 is quick."""
  candidates = _compile_candidates(2, [0.0, 4.0], [])
  bar = autotuner.Progress(False, 2)
  compiled, errors = autotuner._compile_all(candidates, 1.5, None, bar)
  assert list(compiled) == [0]
  assert list(errors) == [1] and errors[1].startswith("TimeoutError")
  assert bar.done == 2


def test_a_timed_out_candidate_is_abandoned_not_awaited():
  """Candidate 1 traces until the test releases it (at most 20 s) against a 1 s timeout:
  `_compile_all` returns without waiting for it."""
  release = threading.Event()

  def stuck(x):
    release.wait(20.0)
    return x

  arg = jax.ShapeDtypeStruct((4,), jnp.float32)
  bar = autotuner.Progress(False, 2)
  start = time.monotonic()
  try:
    compiled, errors = autotuner._compile_all([(lambda x: x + 1, arg), (stuck, arg)], 1.0, 2, bar)
    elapsed = time.monotonic() - start
  finally:
    release.set()
  assert list(compiled) == [0] and list(errors) == [1]
  assert elapsed < 15.0


def test_progress_writes_one_line_per_update_off_a_terminal(capsys):
  """Captured stderr is not a terminal: every update is a line of its own, no carriage return."""
  bar = autotuner.Progress(True, 3, label="t")
  bar.update("a", advance=1)
  bar.update("b", advance=1)
  err = capsys.readouterr().err
  assert "\r" not in err
  lines = err.split("\n")
  assert len(lines) == 3 and lines[2] == ""
  # 20 * 1 / 3 = 6.7 and 20 * 2 / 3 = 13.3 filled: the bar rounds down.
  assert lines[0].startswith("[t] [######--------------] 1/3 ")
  assert lines[1].startswith("[t] [#############-------] 2/3 ")
  assert lines[0].rstrip().endswith(" a") and lines[1].rstrip().endswith(" b")


def test_progress_shows_the_seconds_since_it_started(monkeypatch, capsys):
  """Started at 100.0 s on the monotonic clock and updated at 102.5 s: 2.5 s elapsed."""
  clock = iter([100.0, 102.5])
  monkeypatch.setattr(autotuner, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))
  bar = autotuner.Progress(True, 2, label="t")
  bar.update("a", advance=1)
  assert capsys.readouterr().err.startswith("[t] [##########----------] 1/2    2.5s a")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Block24Fails(ex.BlockedRowRms):
  def _fwd(self, args, config):
    if config.block_cols == 24:
      raise ValueError("block 24 is broken")
    return super()._fwd(args, config)


def test_the_progress_bar_counts_a_compile_and_a_timing_step_per_candidate(monkeypatch, capsys):
  """Two candidates (block 24 fails to compile): 2 compile steps, 1 timing, 1 skip = 4 of 4."""
  monkeypatch.setattr(autotuner.benchmarking, "time_compiled", lambda *a, **k: [1.0])
  bound = _Block24Fails().bind(_x())
  bound.autotune(candidates=[ex.BlockConfig(16), ex.BlockConfig(24)], iterations=1, progress=True)
  lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
  counts = [line.split("] ", 2)[2].split()[0] for line in lines]
  assert counts == ["1/4", "2/4", "3/4", "4/4"]
  assert "timed" in lines[2] and "skipped" in lines[3] and "24" in lines[3]


def test_the_time_budget_counts_from_the_first_op_and_notes_count_from_one(monkeypatch, capsys):
  """Three ops of 0.6 s each and a 1 s budget: the third starts at 1.2 s, skipped.

  The fake clock starts far from zero: the budget counts the time since the start.
  """
  clock = [1000.0]
  monkeypatch.setattr(api, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
  calls = []

  def fake_autotune_call(op, args, **kwargs):
    calls.append((args.x.shape, kwargs["max_workers"]))
    clock[0] += 0.6
    return autotuner.AutotuningData(
      op=op.spec.name,
      implementation=op.name,
      key=arguments.signature_key(args),
      mode=kwargs["mode"],
      config='{"block_cols":16}',
    )

  monkeypatch.setattr(api.autotuner, "autotune_call", fake_autotune_call)

  def f(x, y, z):
    rms = lambda a: ex.row_rms(a, implementation="blocked").sum()
    return rms(x) + rms(y) + rms(z)

  result = tokamax.autotune(
    f, _x(64), _x(128), _x(256), ignore_cache=True, time_budget_s=1.0, max_workers=3
  )
  assert calls == [((8, 64), 3), ((8, 128), 3)]
  (skipped,) = [d for d in result.data if d.config is None]
  assert "[8, 256]" in skipped.key and skipped.errors == ((None, "skipped: time budget"),)
  assert len(result.data) == 3
  notes = [line for line in capsys.readouterr().err.splitlines() if "[tokamax.autotune]" in line]
  assert [n.split()[1] for n in notes] == ["(1/3)", "(2/3)", "(3/3)"]
  assert notes[2].endswith("skipped (time budget)")


def test_candidate_errors_are_listed_in_config_order(monkeypatch):
  """Block 24 fails to compile, then block 16 fails to run: listed 16 first, as configs sort."""

  def time_compiled(*args, **kwargs):
    raise RuntimeError("block 16 crashed")

  monkeypatch.setattr(autotuner.benchmarking, "time_compiled", time_compiled)
  bound = _Block24Fails().bind(_x())
  data = bound.autotune(candidates=[ex.BlockConfig(24), ex.BlockConfig(16)], iterations=1)
  assert data.config is None and not data.timings_ms
  assert [(_block(c), e.split(":")[0]) for c, e in data.errors] == [
    (16, "RuntimeError"),
    (24, "ValueError"),
  ]


def test_bound_heuristics_config_ignores_an_entered_result():
  """`heuristics_config` is what the heuristics pick (64 columns for N = 64), tuned or not."""
  bound = ex.BlockedRowRms().bind(_x())
  with tokamax.AutotuningResult(cache.device_kind(), (_current_entry(16),)):
    assert bound.default_config == ex.BlockConfig(16)
    assert bound.heuristics_config == ex.BlockConfig(64)
    assert bound.autotuning_configs == {ex.BlockConfig(b) for b in (16, 32, 64)}


def test_signature_keys_are_the_text_of_the_shipped_cache_entries():
  """A key names the record type, then each field in order: arrays by dtype and shape, others
  by value. The shipped H200 file holds this very text, so the format cannot drift."""
  q = jax.ShapeDtypeStruct((4, 4096, 32, 128), jnp.bfloat16)
  record = jax.eval_shape(lambda q: attention_spec.SPEC.canonicalize(q, q, q), q)
  array = "(bfloat16[4, 4096, 32, 128])"
  expected = (
    f"AttentionArgs(query={array}, key={array}, value={array}, bias=None, mask=None, "
    "q_seq_lengths=None, kv_seq_lengths=None, scale=0.08838834764831843, is_causal=False, "
    "local_window=None, soft_cap=None, precision=None, batch_shape=(4,))"
  )
  assert arguments.signature_key(record) == expected
  shipped = pathlib.Path(tokamax.__file__).parent / "data" / "NVIDIA_H200.json"
  assert expected in {d["key"] for d in json.loads(shipped.read_text())["data"]}


def test_signature_keys_spell_out_partial_functions():
  """A partial is its function's module and name, its positional arguments, then its keywords
  sorted (so the order they were given in does not matter)."""
  name = "tokamax._src.autotuning.example_user_op.row_rms"
  one = functools.partial(ex.row_rms, 3, b=2, a=1)
  assert arguments._stable_repr(one) == f"partial({name}, 3, a=1, b=2)"
  assert arguments._stable_repr(functools.partial(ex.row_rms, 3, a=1, b=2)) == (
    arguments._stable_repr(one)
  )


@dataclasses.dataclass(frozen=True)
class _VariadicConfig:
  """Tuples of any length: of enums, of nested configs; a list given where a tuple is meant."""

  orders: tuple[_Order, ...] = ()
  stages: tuple[_Inner, ...] = ()
  sizes: tuple[int, ...] = ()


def test_configs_of_variadic_tuples_round_trip():
  config = _VariadicConfig(
    orders=(_Order.COLUMN_MAJOR, _Order.ROW_MAJOR), stages=(_Inner(3), _Inner(1)), sizes=(8, 16, 32)
  )
  text = configs.encode(config)
  assert text == (
    '{"orders":["column","row"],"sizes":[8,16,32],"stages":[{"stages":3},{"stages":1}]}'
  )
  again = configs.decode(_VariadicConfig, text)
  assert again == config and hash(again) == hash(config)
  assert all(isinstance(o, _Order) for o in again.orders)
  # A list encodes as the tuple of the same values would.
  assert configs.encode(_VariadicConfig(sizes=[8, 16, 32])) == configs.encode(
    _VariadicConfig(sizes=(8, 16, 32))
  )


@arguments.op_arguments
class _Record:
  x: jax.Array
  blocks: int = arguments.static()
  mode: str = arguments.static("plain")


def test_static_fields_with_a_default_stay_static():
  """A static field is pytree metadata (not a traced child) whether or not it has a default."""
  record = _Record(x=jnp.ones((2, 3)), blocks=4)
  assert list(arguments.array_fields(record)) == ["x"]
  leaves, tree = jax.tree.flatten(record)
  assert len(leaves) == 1 and leaves[0] is record.x
  assert jax.tree.unflatten(tree, [jnp.zeros((2, 3))]).mode == "plain"
  assert arguments.signature_key(record) == "_Record(x=(float32[2, 3]), blocks=4, mode='plain')"


def test_argument_records_are_frozen():
  """`op_arguments` makes a frozen dataclass: a field of a record cannot be reassigned."""
  record = _Record(x=jnp.ones((2, 3)), blocks=4)
  with pytest.raises(dataclasses.FrozenInstanceError):
    record.blocks = 5
  assert record.blocks == 4


def test_abstract_records_keep_shapes_dtypes_and_static_fields():
  """What autotuning records and tunes: the call's own shapes and dtypes (a bfloat16 call is
  tuned in bfloat16), so its key is the concrete call's."""
  record = ex.SPEC.canonicalize(jnp.ones((2, 4, 16), jnp.bfloat16))
  abstract = arguments.abstract(record)
  assert abstract.x == jax.ShapeDtypeStruct((8, 16), jnp.bfloat16)
  assert abstract.batch_shape == (2, 4)
  assert arguments.signature_key(abstract) == "RowRmsArgs(x=(bfloat16[8, 16]), batch_shape=(2, 4))"
