"""The benchmark runner (`python -m bench.run`) on CPU: one small case, one iteration, its JSON."""

import dataclasses
import enum
import json
import statistics
import types

import pytest

from bench import records
from bench import run as run_lib


class _Compiled:
  def __init__(self, name):
    self.name = name

  def memory_analysis(self):
    return None


def _fake_compile(bcase, c, args_list):
  return _Compiled(c.name), [()]


@pytest.mark.requires("cpu")
def test_runner_writes_valid_records_on_cpu(tmp_path):
  out = tmp_path / "records.json"
  argv = ["--family", "cpu", "--ops", "dot_product_attention", "--only", "causal"]
  argv += ["--modes", "fwd", "--iterations", "1", "--warmup", "1", "--rotations", "1"]
  argv += ["--rounds", "2", "--sweep", "--out", str(out)]
  assert run_lib.main(argv) == 0
  assert not records.validate(json.loads(out.read_text()))
  recs = records.load(str(out))
  assert recs and all(r.op == "dot_product_attention" and r.mode == "fwd" for r in recs)
  assert all(r.method == "wallclock" and len(r.extra["rounds_ms"]) == 2 for r in recs)
  # XLA is the anchor here (no cuDNN on CPU), timed in the same run, never its own record.
  assert all(r.anchor == "xla" and r.anchor_ms > 0 for r in recs)
  assert "xla" not in {r.implementation for r in recs}
  assert any(r.config for r in recs), "--sweep timed no autotuning candidate"
  assert any(r.implementation == "jax.nn" for r in recs), "the op database's anchor is missing"
  # implementation=None is timed beside the named ones and compared with the fastest of them.
  auto = [r for r in recs if r.implementation == run_lib.AUTO]
  assert auto and all(r.extra["fastest"] in ("xla", "xla_chunked") for r in auto)
  for r in auto:
    same = [x for x in recs if x.case == r.case and not x.config]
    named = [x for x in same if x.implementation == r.extra["fastest"]]
    fastest_ms = named[0].median_ms if named else r.anchor_ms
    assert r.extra["fastest_ms"] == fastest_ms
    assert r.extra["ratio_to_fastest"] == pytest.approx(r.median_ms / fastest_ms)


def test_config_dict_is_json():
  class Kind(enum.Enum):
    A = 1

  @dataclasses.dataclass(frozen=True)
  class Config:
    block: int = 64
    kind: Kind = Kind.A
    pair: tuple = (1, 2)

  assert run_lib.config_dict(Config()) == {"block": 64, "kind": "A", "pair": [1, 2]}
  json.dumps(run_lib.config_dict(Config()))


def test_rounds_alternate_the_order_of_contenders(monkeypatch):
  """Odd rounds run the contenders in reverse, so that no contender always follows another."""
  timed = []

  def fake_time(compiled, calls, **kwargs):
    timed.append(compiled.name)
    return types.SimpleNamespace(median_ms=1.0, method="fake")

  monkeypatch.setattr(run_lib, "_compile", _fake_compile)
  monkeypatch.setattr(run_lib.timing, "device_time", fake_time)
  contenders = [run_lib.Contender(name, fn=None) for name in ("a", "b", "c")]
  bcase = types.SimpleNamespace(op="op", id="case")
  ran = run_lib.time_case(
    bcase, contenders, [()], rounds=3, iterations=1, warmup=1, log=lambda _: None
  )
  assert timed == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
  assert [c.rounds_ms for c in ran] == [[1.0] * 3] * 3


@pytest.mark.parametrize(
  ("mode", "fastest", "ratio", "nondeterministic"),
  [
    # A forward: cuDNN is a rival like any other.
    ("fwd", "cudnn", 8.0 / 7.0, None),
    # A training step: `None` keeps deterministic gradients, so Mosaic is the rival and the
    # faster cuDNN is named beside it.
    ("fwd_bwd", "mosaic", 8.0 / 7.5, ("cudnn", 8.0 / 7.0)),
  ],
)
def test_none_is_held_to_the_fastest_implementation_it_may_pick(
  mode, fastest, ratio, nondeterministic
):
  plain = {
    name: run_lib.Contender(name, fn=None, rounds_ms=[ms, ms])
    for name, ms in (("cudnn", 7.0), ("mosaic", 7.5), ("xla", 20.0), ("jax.nn", 6.0))
  }
  got = run_lib._against_fastest("dot_product_attention", mode, plain, 8.0)
  assert got["fastest"] == fastest  # jax.nn is an anchor, not an implementation.
  assert got["ratio_to_fastest"] == pytest.approx(ratio)
  if nondeterministic is None:
    assert "fastest_nondeterministic" not in got
  else:
    assert (got["fastest_nondeterministic"], got["ratio_to_fastest_nondeterministic"]) == (
      nondeterministic[0],
      pytest.approx(nondeterministic[1]),
    )


def test_vary_parses_fields_and_json_values():
  got = run_lib.parse_vary(["num_stages=3,4", "fast=true", "mode=wide", "num_stages=5"])
  assert got == {"num_stages": [3, 4, 5], "fast": [True], "mode": ["wide"]}
  for bad in ("num_stages", "=3", "num_stages=", "a+=1+2"):
    with pytest.raises(ValueError, match="FIELD=V1"):
      run_lib.parse_vary([bad])


def test_vary_parses_fields_varied_together():
  got = run_lib.parse_vary(["num_stages+epi_n=3+256,4+64"])
  assert got == {"num_stages+epi_n": [(3, 256), (4, 64)]}
  with pytest.raises(ValueError, match="one value per field"):
    run_lib.parse_vary(["num_stages+epi_n=3"])


def test_varied_configs_change_the_fields_of_a_joint_key_together():
  @dataclasses.dataclass(frozen=True)
  class Config:
    a: int = 1
    b: int = 2

  instance = types.SimpleNamespace(
    bind=lambda *a, **k: types.SimpleNamespace(args=None),
    _get_heuristics_config=lambda args: Config(),
  )
  impl = types.SimpleNamespace(instance=instance)
  vary = {"a+b": [(1, 2), (3, 4), (1, 5)], "a": [5], "a+c": [(1, 1)]}
  got = run_lib.varied_configs(impl, (), {}, vary)
  # (1, 2) is the heuristics' own; (1, 5) changes one field of the two; a+c names no field c.
  assert got == [Config(a=3, b=4), Config(a=1, b=5), Config(a=5, b=2)]


def test_varied_configs_leave_out_the_values_the_config_rejects():
  @dataclasses.dataclass(frozen=True)
  class Config:
    a: int = 1

    def __post_init__(self):
      if self.a > 4:
        raise ValueError("a > 4")

  instance = types.SimpleNamespace(
    bind=lambda *a, **k: types.SimpleNamespace(args=None),
    _get_heuristics_config=lambda args: Config(),
  )
  impl = types.SimpleNamespace(instance=instance)
  assert run_lib.varied_configs(impl, (), {}, {"a": [2, 8, 3]}) == [Config(a=2), Config(a=3)]


@pytest.mark.requires("cpu")
def test_vary_times_the_heuristic_config_with_one_field_changed(tmp_path):
  out = tmp_path / "records.json"
  argv = ["--family", "cpu", "--ops", "dot_product_attention", "--only", "causal"]
  argv += ["--modes", "fwd", "--iterations", "1", "--warmup", "1", "--rotations", "1"]
  argv += ["--impls", "xla_chunked", "--vary", "kv_chunk_size=64,128", "--vary", "no_such=1"]
  argv += ["--out", str(out)]
  assert run_lib.main(argv) == 0
  varied = [r for r in records.load(str(out)) if r.config]
  assert sorted(r.config["kv_chunk_size"] for r in varied) == [64, 128]
  assert {r.implementation for r in varied} == {"xla_chunked"}


def test_time_case_warms_up_once_and_drops_a_contender_that_fails_later(monkeypatch):
  """Warm-up runs before the first round only; a contender whose later round fails has no
  record, though its first round had timed."""
  calls = []

  def fake_time(compiled, args, *, warmup, iterations):
    calls.append((compiled.name, warmup))
    if compiled.name == "b" and len(calls) > 2:
      raise RuntimeError("lost the device")
    return types.SimpleNamespace(median_ms=1.0, method="fake")

  monkeypatch.setattr(run_lib, "_compile", _fake_compile)
  monkeypatch.setattr(run_lib.timing, "device_time", fake_time)
  contenders = [run_lib.Contender(name, fn=None) for name in ("a", "b")]
  bcase = types.SimpleNamespace(op="op", id="case")
  ran = run_lib.time_case(
    bcase, contenders, [()], rounds=2, iterations=1, warmup=5, log=lambda _: None
  )
  assert [c.name for c in ran] == ["a"]
  assert calls == [("a", 5), ("b", 5), ("b", 1), ("a", 1)]


def test_case_records_compare_with_the_ops_anchor_of_the_same_run():
  def contender(name, rounds):
    return run_lib.Contender(name, fn=None, rounds_ms=rounds)

  timed = [
    contender("xla", [20.0, 21.0, 30.0]),  # Timed first, but cuDNN is attention's anchor.
    contender("mosaic", [8.0, 9.0, 8.5]),
    contender("cudnn", [7.0, 7.5, 10.0]),
  ]
  case = types.SimpleNamespace(
    feature="plain", id="c", shape_dict={"b": 2, "rows": (4, 8)}, dtype="bfloat16"
  )
  bcase = types.SimpleNamespace(op="dot_product_attention", mode="fwd_bwd", case=case)
  env = {"commit": "abc", "date": None}
  recs = run_lib.case_records(bcase, timed, env, "dev", types.SimpleNamespace(flops=1e12))
  by_name = {r.implementation: r for r in recs}
  assert set(by_name) == {"xla", "mosaic"}  # The anchor has no record of its own.
  mosaic = by_name["mosaic"]
  assert (mosaic.anchor, mosaic.anchor_ms, mosaic.median_ms) == ("cudnn", 7.5, 8.5)
  per_round = statistics.median([8.0 / 7.0, 9.0 / 7.5, 8.5 / 10.0])
  assert mosaic.extra["ratio_median_of_rounds"] == pytest.approx(per_round)
  # A training step counts 3.5 forwards of FLOPs.
  assert mosaic.extra["tflops_per_s"] == pytest.approx(3.5 * 1e12 / 8.5e-3 / 1e12)
  assert mosaic.shape == {"b": 2, "rows0": 4, "rows1": 8}
