"""tokamax.autotune, AutotuningResult and the config cache, on CPU (issue 7).

The XLA chunked implementations are the search spaces: the attention's key
chunk and the loss's vocabulary chunk change the scan's trip count, which the
tests read from the lowered StableHLO.
"""

import dataclasses
import functools
import io
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax._src import arguments
from tokamax._src import config as config_lib
from tokamax._src.autotuning import api, cache, configs
from tokamax._src.autotuning import example_user_op as ex
from tokamax._src.ops.attention import xla_chunked
from tokamax._src.ops.gated_linear_unit import spec as glu_spec
from tokamax._src.ops.linear_softmax_cross_entropy_loss import chunked_xla

S = 256  # Key length: chunk candidates 128 and 256.
V = 2048  # Vocabulary: chunk candidates 1024 and 2048.
_TRIP = re.compile(
  r"cond \{\s*%\S+ = stablehlo\.constant dense<(\d+)> : tensor<i32>\s*%\S+ = stablehlo\.compare\s+LT"
)


def trip_counts(lowered_text: str) -> list[int]:
  """The trip counts of the scans (while loops with a constant bound) in StableHLO."""
  return [int(n) for n in _TRIP.findall(lowered_text)]


def make_inputs(seed: int = 0):
  keys = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(keys[0], (1, S, 2, 16), jnp.float32)
  k = jax.random.normal(keys[1], (1, S, 2, 16), jnp.float32)
  v = jax.random.normal(keys[2], (1, S, 2, 16), jnp.float32)
  x = jax.random.normal(keys[3], (8, 32), jnp.float32)
  w = 0.2 * jax.random.normal(keys[4], (32, V), jnp.float32)
  labels = jax.random.randint(keys[5], (8,), 0, V)
  return q, k, v, x, w, labels


def loss(q, k, v, x, w, labels):
  o = tokamax.dot_product_attention(q, k, v, implementation="xla_chunked")
  h = tokamax.layer_norm(x, None, None, implementation="xla")
  ce = tokamax.linear_softmax_cross_entropy_loss(h, labels, w, implementation="chunked_xla")
  return jnp.sum(o * o) + ce


def attention_only(q):
  return tokamax.dot_product_attention(q, q, q, implementation="xla_chunked")


def chunk_result(chunk: int, q, heuristic: int | dict | None = None) -> tokamax.AutotuningResult:
  """A result fixing the attention key chunk of `attention_only(q)`.

  `heuristic`: the heuristics' config (or key chunk) when it was tuned.
  """
  (bound,) = api.get_bound_args(attention_only, q)
  data = api.AutotuningData(
    op=bound.op.spec.name,
    implementation=bound.op.name,
    key=bound.key,
    mode="forward",
    config=json.dumps({"kv_chunk_size": chunk}),
    heuristic=None
    if heuristic is None
    else json.dumps(heuristic if isinstance(heuristic, dict) else {"kv_chunk_size": heuristic}),
  )
  return tokamax.AutotuningResult(jax.devices()[0].device_kind, (data,))


@pytest.fixture(scope="module")
def tuned():
  """The jitted gradient of `loss`, its inputs and its autotuning result."""
  args = make_inputs()
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
  return grad, args, tokamax.autotune(grad, *args, iterations=3, progress=False)


def names(found) -> dict[tuple[str, str], str]:
  return {(b.op.spec.name, b.op.name): mode for b, mode in found}


def test_finds_ops_in_jitted_function_and_gradient():
  args = make_inputs()
  forward = names(api.find_ops(jax.jit(loss), *args))
  assert forward == {
    ("dot_product_attention", "xla_chunked"): "forward",
    ("layer_norm", "xla"): "forward",
    ("linear_softmax_cross_entropy_loss", "chunked_xla"): "forward",
  }
  grad = names(api.find_ops(jax.jit(jax.grad(loss, argnums=(0, 3))), *args))
  # The chunked implementations' custom backward passes ran: their configs matter there.
  assert grad[("dot_product_attention", "xla_chunked")] == "forward_and_vjp"
  assert grad[("linear_softmax_cross_entropy_loss", "chunked_xla")] == "forward_and_vjp"


def test_an_op_in_the_gradient_and_again_forward_is_tuned_with_its_vjp():
  """The gradient's call and a later forward-only call of one signature: one entry, its
  backward pass timed too."""
  q = make_inputs()[0]

  def f(q):
    grad = jax.grad(lambda q: jnp.sum(attention_only(q)))(q)
    return jnp.sum(grad) + jnp.sum(attention_only(q))

  assert names(api.find_ops(f, q)) == {("dot_product_attention", "xla_chunked"): "forward_and_vjp"}


def test_modes_of_one_implementation_merge_across_calls(monkeypatch):
  """With all_implementations, "xla_chunked" is reached from its own call in the gradient and
  from the forward-only "xla" call: it is tuned once, with its backward pass."""
  tuned = []

  def fake_autotune_call(op, args, *, mode, **kwargs):
    tuned.append((op.name, mode))
    key = arguments.signature_key(args)
    return api.AutotuningData(op.spec.name, op.name, key, mode, config=None)

  monkeypatch.setattr(api.autotuner, "autotune_call", fake_autotune_call)
  q = make_inputs()[0]

  def f(q):
    grad = jax.grad(lambda q: jnp.sum(attention_only(q)))(q)
    plain = tokamax.dot_product_attention(q, q, q, implementation="xla")
    return jnp.sum(grad) + jnp.sum(plain)

  tokamax.autotune(f, q, all_implementations=True, ignore_cache=True, progress=False)
  assert [mode for name, mode in tuned if name == "xla_chunked"] == ["forward_and_vjp"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _ChunkedWithXlaGradient(xla_chunked.XlaChunkedAttention):
  """Chunked forward whose gradient comes from the XLA implementation."""

  differentiable = False

  def _bwd_unsupported_reason(self, args):
    return "test: the gradient comes from the XLA implementation"


def test_finds_ops_that_only_appear_in_the_gradient():
  q = make_inputs()[0]
  op = _ChunkedWithXlaGradient()

  def f(q):
    return jnp.sum(tokamax.dot_product_attention(q, q, q, implementation=op))

  assert ("dot_product_attention", "xla") not in names(api.find_ops(f, q))
  assert ("dot_product_attention", "xla") in names(api.find_ops(jax.jit(jax.grad(f)), q))


def test_finds_ops_of_an_already_traced_jitted_function():
  q = make_inputs()[0]
  f = jax.jit(attention_only)
  f(q)  # Traced and cached; finding the ops must trace again.
  assert list(names(api.find_ops(f, q))) == [("dot_product_attention", "xla_chunked")]
  # Shapes suffice.
  assert len(api.get_bound_args(f, jax.ShapeDtypeStruct(q.shape, q.dtype))) == 1


def test_autotune_tunes_chunk_sizes_of_the_jitted_gradient(tuned):
  _, _, result = tuned
  assert result.device_kind == jax.devices()[0].device_kind
  assert result.library_version == tokamax.__version__
  by_op = {(d.op, d.implementation): d for d in result.data}
  # layer_norm[xla] has nothing to tune, so it has no entry.
  assert set(by_op) == {
    ("dot_product_attention", "xla_chunked"),
    ("linear_softmax_cross_entropy_loss", "chunked_xla"),
  }
  attention = by_op[("dot_product_attention", "xla_chunked")]
  assert attention.mode == "forward_and_vjp"
  assert {json.loads(c)["kv_chunk_size"] for c, _ in attention.timings_ms} == {128, 256}
  assert not attention.errors
  times = [t for _, t in attention.timings_ms]
  assert times == sorted(times) and all(t > 0 for t in times)
  assert attention.config == attention.timings_ms[0][0]
  loss_data = by_op[("linear_softmax_cross_entropy_loss", "chunked_xla")]
  assert {json.loads(c)["vocab_chunk_size"] for c, _ in loss_data.timings_ms} == {1024, 2048}
  # Configs decode to the implementation's config class.
  (bound,) = api.get_bound_args(attention_only, make_inputs()[0])
  assert isinstance(
    result.data_for(bound.op, attention.key).fastest_config, xla_chunked.ChunkedConfig
  )


def test_dumps_loads_round_trip(tuned, tmp_path):
  _, _, result = tuned
  text = result.dumps()
  obj = json.loads(text)
  assert obj["format"] == "tokamax.AutotuningResult" and obj["format_version"] == 1
  assert obj["device_kind"] == result.device_kind and obj["library_version"] == tokamax.__version__
  again = tokamax.AutotuningResult.loads(text)
  assert again == result and hash(again) == hash(result)
  assert again.dumps() == text
  assert [dataclasses.replace(d, config_cls=None) for d in again.data] == [
    dataclasses.replace(d, config_cls=None) for d in result.data
  ]
  path = tmp_path / "result.json"
  result.dump(path)
  assert tokamax.AutotuningResult.load(path) == result
  buffer = io.StringIO()
  result.dump(buffer)
  assert tokamax.AutotuningResult.load(io.StringIO(buffer.getvalue())) == result
  with pytest.raises(ValueError, match="format"):
    tokamax.AutotuningResult.loads(json.dumps({"format": "other"}))


def test_context_manager_changes_the_config_in_the_lowered_program():
  q = make_inputs()[0]
  traces = []

  @jax.jit
  def f(q):
    traces.append(1)
    return attention_only(q)

  assert trip_counts(f.lower(q).as_text()) == [1]  # Heuristic chunk 256: one step.
  with chunk_result(64, q):
    assert trip_counts(f.lower(q).as_text()) == [4]
    with chunk_result(128, q):  # The innermost result wins.
      assert trip_counts(f.lower(q).as_text()) == [2]
    assert trip_counts(f.lower(q).as_text()) == [4]
  assert trip_counts(f.lower(q).as_text()) == [1]
  # Calls retrace inside a result and reuse the trace of an equal result.
  f(q)
  n = len(traces)
  with chunk_result(32, q):
    f(q)
  assert len(traces) == n + 1
  with chunk_result(32, q):  # An equal result (another object).
    f(q)
  assert len(traces) == n + 1


def test_reloaded_result_gives_bitwise_the_same_outputs(tuned):
  grad, args, result = tuned
  with result:
    tuned_out = grad(*args)
  reloaded = tokamax.AutotuningResult.loads(result.dumps())
  fresh = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
  with reloaded:
    reloaded_out = fresh(*args)
  for a, b in zip(tuned_out, reloaded_out, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The tuned configs are the ones in use: fixing them by hand gives the same bits.
  by_op = {d.implementation: d for d in result.data}
  attn_cfg = xla_chunked.ChunkedConfig(**json.loads(by_op["xla_chunked"].config))
  loss_cfg = chunked_xla.ChunkedLossConfig(**json.loads(by_op["chunked_xla"].config))

  def fixed_loss(q, k, v, x, w, labels):
    o = tokamax.dot_product_attention(
      q, k, v, implementation=xla_chunked.XlaChunkedAttention(config=attn_cfg)
    )
    h = tokamax.layer_norm(x, None, None, implementation="xla")
    ce = tokamax.linear_softmax_cross_entropy_loss(
      h, labels, w, implementation=chunked_xla.ChunkedXlaLoss(config=loss_cfg)
    )
    return jnp.sum(o * o) + ce

  fixed_out = jax.jit(jax.grad(fixed_loss, argnums=(0, 1, 2, 3, 4)))(*args)
  for a, b in zip(tuned_out, fixed_out, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_merge():
  q = make_inputs()[0]
  a, b = chunk_result(64, q), chunk_result(128, q)
  assert a.merge(b).data == b.data  # Same key: the later result wins.
  assert (b | a).data == a.data
  other = dataclasses.replace(a.data[0], key=a.data[0].key + "-other")
  merged = a.merge(b, tokamax.AutotuningResult(a.device_kind, (other,)))
  assert len(merged) == 2
  assert json.loads(
    merged.data_for(api.get_bound_args(attention_only, q)[0].op, a.data[0].key).config
  ) == {"kv_chunk_size": 128}
  with pytest.raises(ValueError, match="device kinds"):
    a.merge(tokamax.AutotuningResult(f"not {a.device_kind}", ()))


def test_cache_miss_options():
  keys = jax.random.split(jax.random.key(3), 2)
  q = jax.random.normal(keys[0], (1, 384, 1, 8), jnp.float32)  # A shape no result covers.
  x = jax.random.normal(keys[1], (4, 8), jnp.float32)
  f = jax.jit(attention_only)
  norm = jax.jit(lambda x: tokamax.layer_norm(x, None, None, implementation="xla"))
  assert tokamax.config.OPTIONS.cache_miss == "heuristics"
  assert trip_counts(f.lower(q).as_text()) == [1]  # Heuristic chunk min(512, 384).
  f(q)
  with tokamax.config.override(cache_miss="error"):
    with pytest.raises(LookupError, match="no tuned config"):
      f(q)  # Retraced under the new option even though `f` was cached.
    norm(x)  # Nothing to tune: no error.
  try:
    with tokamax.config.override(cache_miss="autotune"):
      lowered = f.lower(q).as_text()
    (data,) = cache._TUNED_ON_MISS.values()
    assert json.loads(data.heuristic) == {"kv_chunk_size": 384}  # min(512, 384), as traced above.
    chunk = json.loads(data.config)["kv_chunk_size"]
    assert {json.loads(c)["kv_chunk_size"] for c, _ in data.timings_ms} == {128, 256, 384}
    assert trip_counts(lowered) == [-(-384 // chunk)]
  finally:
    cache.clear_tuned_on_miss()
  with pytest.raises(ValueError, match="unknown option"), tokamax.config.override(no_such_option=1):
    pass


def test_cache_miss_option_reads_its_environment_variable(monkeypatch):
  """TOKAMAX_CACHE_MISS sets the default of `cache_miss` (read when the options are made)."""
  for value, want in (("error", "ERROR"), ("autotune", "AUTOTUNE"), ("heuristics", "HEURISTICS")):
    monkeypatch.setenv("TOKAMAX_CACHE_MISS", value)
    assert config_lib._Options().cache_miss is tokamax.config.CacheMiss[want]
  monkeypatch.delenv("TOKAMAX_CACHE_MISS")
  assert config_lib._Options().cache_miss is tokamax.config.CacheMiss.HEURISTICS
  monkeypatch.setenv("TOKAMAX_CACHE_MISS", "bogus")
  with pytest.raises(ValueError, match="bogus"):
    config_lib._Options()


def test_use_default_cache_option_reads_its_environment_variable():
  """TOKAMAX_USE_DEFAULT_CACHE=0 turns the shipped cache off (read when tokamax is imported)."""
  root = pathlib.Path(__file__).resolve().parents[2]
  env = dict(os.environ, TOKAMAX_USE_DEFAULT_CACHE="0", JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(root), env.get("PYTHONPATH", "")])
  script = "import tokamax\nprint('use_default_cache', tokamax.config.OPTIONS.use_default_cache)\n"
  run = subprocess.run(
    [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True, timeout=120
  )
  assert "use_default_cache False" in run.stdout.splitlines()


def test_override_coerces_checks_and_restores_values():
  """`override` takes option values in their options' types (refusing what they cannot be)
  and restores every option afterwards, also when its block raises."""
  options = tokamax.config.OPTIONS
  before = dataclasses.asdict(options)
  with tokamax.config.override(cache_miss="error", use_default_cache=0) as inside:
    assert inside.cache_miss is tokamax.config.CacheMiss.ERROR
    assert inside.use_default_cache is False
  assert dataclasses.asdict(options) == before
  with pytest.raises(ValueError, match="bogus"), tokamax.config.override(cache_miss="bogus"):
    pass
  assert dataclasses.asdict(options) == before
  with pytest.raises(RuntimeError, match="inside"), tokamax.config.override(cache_miss="autotune"):
    raise RuntimeError("inside")
  assert dataclasses.asdict(options) == before


def test_nested_overrides_retrace_with_every_option():
  """A trace made inside `override(use_default_cache=False)` alone is not reused inside it
  nested in `override(cache_miss="error")`: there the miss raises."""
  x = jax.random.normal(jax.random.key(6), (8, 64), jnp.float32)
  f = jax.jit(lambda x: ex.row_rms(x, implementation="blocked"))
  with tokamax.config.override(use_default_cache=False):
    f(x)  # A miss under "heuristics": traced and cached.
  with (
    tokamax.config.override(cache_miss="error"),
    tokamax.config.override(use_default_cache=False),
    pytest.raises(LookupError, match="no tuned config"),
  ):
    f(x)


def test_default_cache(monkeypatch, tmp_path):
  q = make_inputs()[0]
  kind = jax.devices()[0].device_kind
  assert cache.file_name("NVIDIA H200") == "NVIDIA_H200.json"
  chunk_result(64, q, heuristic=S).dump(tmp_path / cache.file_name(kind))
  monkeypatch.setattr(cache, "DATA_DIR", tmp_path)
  cache.default_result.cache_clear()
  try:
    f = jax.jit(lambda q: attention_only(q))  # A function JAX has not traced before.
    assert trip_counts(f.lower(q).as_text()) == [4]  # From the shipped file.
    with tokamax.config.override(use_default_cache=False):
      assert trip_counts(f.lower(q).as_text()) == [1]
    with chunk_result(128, q):  # An entered result comes first.
      assert trip_counts(f.lower(q).as_text()) == [2]
  finally:
    cache.default_result.cache_clear()


@pytest.mark.parametrize("heuristic", [None, 128], ids=["not_recorded", "another_heuristic"])
def test_default_cache_skips_entries_tuned_under_other_heuristics(monkeypatch, tmp_path, heuristic):
  """A shipped entry tuned when the heuristics chose otherwise predates them: heuristics win."""
  q = make_inputs()[0]
  chunk_result(64, q, heuristic=heuristic).dump(
    tmp_path / cache.file_name(jax.devices()[0].device_kind)
  )
  monkeypatch.setattr(cache, "DATA_DIR", tmp_path)
  cache.default_result.cache_clear()
  try:
    f = jax.jit(lambda q: attention_only(q))
    assert trip_counts(f.lower(q).as_text()) == [1]  # The heuristic chunk (S), not the entry's.
    with chunk_result(64, q, heuristic=heuristic):  # An entered result is taken as it is.
      assert trip_counts(f.lower(q).as_text()) == [4]
  finally:
    cache.default_result.cache_clear()


def test_default_cache_skips_entries_of_an_older_config(monkeypatch, tmp_path):
  """A shipped entry missing a config field was tuned on an older kernel: heuristics instead."""
  q = make_inputs()[0]
  kind = jax.devices()[0].device_kind

  @dataclasses.dataclass(frozen=True)
  class NewerConfig(xla_chunked.ChunkedConfig):
    unroll: int = 1  # A field the shipped entry predates.

  monkeypatch.setattr(xla_chunked.XlaChunkedAttention, "config_cls", NewerConfig)
  (bound,) = api.get_bound_args(attention_only, q)
  # Today's heuristic, so that only the missing field makes the entry stale.
  heuristic = json.loads(configs.encode(bound.op._get_heuristics_config(bound.args)))
  chunk_result(64, q, heuristic=heuristic).dump(tmp_path / cache.file_name(kind))
  monkeypatch.setattr(cache, "DATA_DIR", tmp_path)
  cache.default_result.cache_clear()
  try:
    f = jax.jit(lambda q: attention_only(q))
    assert trip_counts(f.lower(q).as_text()) == [1]  # The heuristic chunk, not the entry's.
    with chunk_result(128, q):  # An entered result is taken as it is.
      assert trip_counts(f.lower(q).as_text()) == [2]
  finally:
    cache.default_result.cache_clear()


def test_shipped_default_caches_load():
  for path in sorted(cache.DATA_DIR.glob("*.json")):
    result = tokamax.AutotuningResult.load(path)
    assert path.name == cache.file_name(result.device_kind)
    assert all(d.config is not None for d in result.data)
    assert all(d.heuristic is not None for d in result.data), "written before heuristics were"
    # Stable JSON: today's writer reproduces the stored file byte for byte (no churn on a re-tune).
    assert result.dumps() == path.read_text(), f"{path.name} is not stored as dumps() writes it"


def test_signature_keys_name_functions_not_their_addresses():
  x = jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((4096, 2, 14336), jnp.bfloat16)

  def key(activation):
    return arguments.signature_key(glu_spec.SPEC.canonicalize(x, w, activation=activation))

  assert "silu" in key(jax.nn.silu) and "0x" not in key(jax.nn.silu)
  exact = functools.partial(jax.nn.gelu, approximate=False)
  assert "approximate=False" in key(exact) and key(exact) != key(jax.nn.gelu)
  # So that an entry tuned in one process (a shipped cache) is found in another.
  script = (
    "import jax, jax.numpy as jnp\n"
    "from tokamax._src import arguments\n"
    "from tokamax._src.ops.gated_linear_unit import spec\n"
    "x = jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16)\n"
    "w = jax.ShapeDtypeStruct((4096, 2, 14336), jnp.bfloat16)\n"
    "print(arguments.signature_key(spec.SPEC.canonicalize(x, w, activation=jax.nn.silu)))\n"
  )
  root = pathlib.Path(__file__).resolve().parents[2]
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(root), env.get("PYTHONPATH", "")])
  other = subprocess.run(
    [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True, timeout=120
  )
  assert other.stdout.strip() == key(jax.nn.silu)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _FlakyRowRms(ex.BlockedRowRms):
  """Block 24 fails to trace, block 40 takes too long to compile."""

  def _fwd(self, args, config):
    if config.block_cols == 24:
      raise ValueError("block 24 is broken")
    if config.block_cols == 40:
      time.sleep(3.0)
    return super()._fwd(args, config)


def test_candidate_errors_and_timeouts_are_recorded_not_fatal():
  x = jax.random.normal(jax.random.key(4), (8, 64), jnp.float32)
  bound = _FlakyRowRms().bind(x)
  data = bound.autotune(  # BoundArguments.autotune: one op call.
    candidates=[ex.BlockConfig(b) for b in (16, 24, 32, 40)], timeout_s=1.0, iterations=2
  )
  assert {json.loads(c)["block_cols"] for c, _ in data.timings_ms} == {16, 32}
  errors = {json.loads(c)["block_cols"]: e for c, e in data.errors}
  assert set(errors) == {24, 40}
  assert "block 24 is broken" in errors[24]
  assert errors[40].startswith("TimeoutError")
  assert json.loads(data.config)["block_cols"] in (16, 32)


def test_user_op_is_tunable(capsys):
  x = jax.random.normal(jax.random.key(5), (16, 256), jnp.float32)
  f = jax.jit(jax.grad(lambda x: jnp.sum(ex.row_rms(x) ** 2)))
  result = tokamax.autotune(f, x, iterations=2)
  assert "[tokamax.autotune]" in capsys.readouterr().err  # The progress report.
  (data,) = result.data
  assert (data.op, data.implementation) == ("example_row_rms", "blocked")
  assert {json.loads(c)["block_cols"] for c, _ in data.timings_ms} == {16, 32, 64, 128}
  chunk = json.loads(data.config)["block_cols"]
  g = jax.jit(lambda x: ex.row_rms(x))
  assert trip_counts(g.lower(x).as_text()) == [2]  # Heuristic block 128.
  with result:
    assert trip_counts(g.lower(x).as_text()) == [256 // chunk]
    out = np.asarray(g(x), np.float64)
  x64 = np.asarray(x, np.float64)
  np.testing.assert_allclose(out, np.sqrt((x64 * x64).mean(-1)), rtol=1e-5)


def test_ignore_cache_and_all_implementations(tuned, capsys):
  grad, args, result = tuned
  with result:
    cached = tokamax.autotune(grad, *args, iterations=2)
  assert cached == result  # Taken from the active result, not timed again.
  assert capsys.readouterr().err.count(": cached") == 2
  q = args[0]

  def plain(q):
    return tokamax.dot_product_attention(q, q, q, implementation="xla")

  assert len(tokamax.autotune(plain, q, progress=False)) == 0  # XLA has nothing to tune.
  every = tokamax.autotune(plain, q, all_implementations=True, iterations=2, progress=False)
  # The tunable implementations that take float32 here: Triton's only on a GPU.
  tunable = {"xla_chunked"} | ({"triton"} if jax.default_backend() == "gpu" else set())
  assert {d.implementation for d in every.data} == tunable
  assert {d.op for d in every.data} == {"dot_product_attention"}
  with result:
    fresh = tokamax.autotune(
      jax.jit(attention_only), q, ignore_cache=True, iterations=2, progress=False
    )
  assert fresh.data[0].timings_ms  # Timed again although the shape is covered by `result`.


def _fields(data):
  return [(d.op, d.implementation, d.key, d.mode, d.config, d.timings_ms, d.errors) for d in data]


def test_round_trip_keeps_failed_candidates():
  """Errors of failed candidates (and of a whole op) survive dumps/loads exactly."""
  x = jax.random.normal(jax.random.key(5), (8, 64), jnp.float32)
  tuned = (
    _FlakyRowRms().bind(x).autotune(candidates=[ex.BlockConfig(b) for b in (16, 24)], iterations=2)
  )
  assert [json.loads(c)["block_cols"] for c, _ in tuned.errors] == [24]
  config = json.dumps({"block_cols": 8}, sort_keys=True, separators=(",", ":"))
  whole_op = api.AutotuningData(
    op="layer_norm",
    implementation="triton",
    key="whole-op-failure",
    mode="forward_and_vjp",
    config=None,
    errors=((None, 'RuntimeError: "quoted", multi\nline, ünïcode'),),
  )
  mixed = api.AutotuningData(
    op="layer_norm",
    implementation="triton",
    key="mixed",
    mode="forward",
    config=config,
    timings_ms=((config, 0.125),),
    errors=(
      ('{"block_cols":16}', "TimeoutError: compilation took longer than 1 s"),
      ('{"block_cols":32}', "ValueError: block 32 is broken"),
    ),
  )
  result = tokamax.AutotuningResult("cpu", (tuned, whole_op, mixed))
  text = result.dumps()
  again = tokamax.AutotuningResult.loads(text)
  assert _fields(again.data) == _fields(result.data)
  assert again.dumps() == text and again == result
  by_key = {d.key: d for d in again.data}
  assert by_key["whole-op-failure"].errors == whole_op.errors
  assert by_key["whole-op-failure"].fastest_config is None
  assert by_key["mixed"].errors == mixed.errors
  assert by_key[tuned.key].errors == tuned.errors
  entries = {d["key"]: d for d in json.loads(text)["data"]}
  assert entries["mixed"]["errors"] == [
    [{"block_cols": 16}, "TimeoutError: compilation took longer than 1 s"],
    [{"block_cols": 32}, "ValueError: block 32 is broken"],
  ]
  assert entries["whole-op-failure"]["errors"] == [[None, whole_op.errors[0][1]]]
  # Errors are part of the identity: a result without them is another result.
  stripped = tokamax.AutotuningResult(
    "cpu", tuple(dataclasses.replace(d, errors=()) for d in result.data)
  )
  assert stripped != result and stripped.dumps() != text


def test_signature_keys_tell_dtypes_and_shapes_apart():
  """A config tuned for one dtype or shape is not looked up for another."""
  w = jax.ShapeDtypeStruct((64, 2, 128), jnp.float32)

  def key(shape, dtype, weights=w):
    x = jax.ShapeDtypeStruct(shape, dtype)
    return arguments.signature_key(glu_spec.SPEC.canonicalize(x, weights, activation=jax.nn.silu))

  base = key((8, 64), jnp.float32)
  assert base == key((8, 64), jnp.float32)
  assert base != key((8, 64), jnp.bfloat16)
  assert base != key((8, 64), jnp.float32, jax.ShapeDtypeStruct((64, 2, 128), jnp.bfloat16))
  assert base != key((16, 64), jnp.float32)
  assert "float32" in base and "bfloat16" in key((8, 64), jnp.bfloat16)


@pytest.mark.parametrize("on_forward", [False, True])
def test_ops_tuned_on_forward_are_timed_without_their_vjp(monkeypatch, on_forward):
  """An op whose VJP reconfigures its forward is tuned on the forward, even under `jax.grad`."""
  monkeypatch.setattr(xla_chunked.XlaChunkedAttention, "tuned_on_forward", on_forward)
  q = make_inputs()[0]
  grad = jax.grad(lambda q: jnp.sum(attention_only(q)))
  result = tokamax.autotune(grad, q, ignore_cache=True, iterations=1)
  (data,) = [d for d in result.data if d.op == "dot_product_attention"]
  assert data.mode == ("forward" if on_forward else "forward_and_vjp")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _TwoPassConfig:
  chunk: int = 128
  bwd_chunk: int = 128
  BACKWARD_FIELDS = ("bwd_chunk",)


def test_forward_tuning_times_one_candidate_per_forward_program(monkeypatch):
  """Candidates that differ only in BACKWARD_FIELDS run one forward program: a forward
  alone is timed once per forward variant, with the heuristics' backward fields."""
  timed = []
  real = api.autotuner.benchmarking.standardize_function

  def record(fn, *args, **kwargs):
    timed.append((fn.op.config, kwargs["mode"]))
    return real(fn, *args, **kwargs)

  monkeypatch.setattr(api.autotuner.benchmarking, "standardize_function", record)
  candidates = {_TwoPassConfig(chunk=c, bwd_chunk=b) for c in (128, 256) for b in (64, 128, 256)}
  heuristic = _TwoPassConfig(chunk=128, bwd_chunk=64)
  op_cls = xla_chunked.XlaChunkedAttention
  monkeypatch.setattr(op_cls, "_get_heuristics_config", lambda self, a: heuristic)
  monkeypatch.setattr(op_cls, "_fwd", lambda self, a, c: (a.query, None))
  op = op_cls()
  q = make_inputs()[0]
  bound = op.bind(q, q, q)
  api.autotuner.autotune_call(op, bound.args, candidates=candidates, iterations=1, progress=False)
  assert sorted(timed, key=repr) == sorted(
    [(_TwoPassConfig(chunk=c, bwd_chunk=64), "forward") for c in (128, 256)], key=repr
  )
  timed.clear()
  api.autotuner.autotune_call(
    op, bound.args, mode="forward_and_vjp", candidates=candidates, iterations=1, progress=False
  )
  assert len(timed) == len(candidates)


def test_autotune_hands_its_options_to_the_autotuner(monkeypatch, capsys):
  """Every timing option reaches the per-op autotuner; a call in the gradient is timed with its
  backward pass, a `BoundArguments` handed in directly on its forward; progress=False is quiet."""
  calls = []

  def fake_autotune_call(op, args, **kwargs):
    calls.append((op.name, kwargs))
    key = arguments.signature_key(args)
    return api.AutotuningData(op.spec.name, op.name, key, kwargs["mode"], config=None)

  monkeypatch.setattr(api.autotuner, "autotune_call", fake_autotune_call)
  q = make_inputs()[0]
  f = jax.grad(lambda q: jnp.sum(attention_only(q)))
  options = dict(
    timeout_s=12.5, max_workers=3, iterations=7, method="wallclock", seed=11, progress=False
  )
  tokamax.autotune(f, q, ignore_cache=True, **options)
  assert calls == [("xla_chunked", {"mode": "forward_and_vjp", **options})]
  calls.clear()
  tokamax.autotune(api.get_bound_args(f, q), ignore_cache=True, **options)
  assert calls == [("xla_chunked", {"mode": "forward", **options})]
  assert "[tokamax.autotune]" not in capsys.readouterr().err


def test_an_op_whose_autotuning_raises_is_recorded_with_the_error(monkeypatch):
  """ignore_errors: the op gets an entry without config naming the error; else it raises."""

  def fake_autotune_call(op, args, **kwargs):
    raise RuntimeError("the device went away")

  monkeypatch.setattr(api.autotuner, "autotune_call", fake_autotune_call)
  q = make_inputs()[0]
  result = tokamax.autotune(attention_only, q, ignore_cache=True, progress=False)
  (data,) = result.data
  assert (data.op, data.implementation, data.mode) == (
    "dot_product_attention",
    "xla_chunked",
    "forward",
  )
  assert data.config is None
  assert data.errors == ((None, "RuntimeError: the device went away"),)
  with pytest.raises(RuntimeError, match="the device went away"):
    tokamax.autotune(attention_only, q, ignore_cache=True, ignore_errors=False, progress=False)
  # The entry of a call in the gradient keeps its mode.
  grad = jax.grad(lambda q: jnp.sum(attention_only(q)))
  (data,) = tokamax.autotune(grad, q, ignore_cache=True, progress=False).data
  assert (data.mode, data.config) == ("forward_and_vjp", None)
