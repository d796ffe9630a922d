"""The benchmark runner (`python -m bench.run`) on CPU: one small case, one iteration, its JSON."""

import dataclasses
import enum
import json
import statistics
import types

import jax
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
  class ExampleConfig:
    block: int = 64
    kind: Kind = Kind.A
    pair: tuple = (1, 2)

  assert run_lib.config_dict(ExampleConfig()) == {"block": 64, "kind": "A", "pair": [1, 2]}
  json.dumps(run_lib.config_dict(ExampleConfig()))
  # A config that is not a dataclass is still an object (a record's `config` must be one).
  assert run_lib.config_dict(Kind.A) == {"value": "A"}


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
  class TwoFieldConfig:
    a: int = 1
    b: int = 2

  instance = types.SimpleNamespace(
    bind=lambda *a, **k: types.SimpleNamespace(args=None),
    _get_heuristics_config=lambda args: TwoFieldConfig(),
  )
  impl = types.SimpleNamespace(instance=instance)
  vary = {"a+b": [(1, 2), (3, 4), (1, 5)], "a": [5], "a+c": [(1, 1)]}
  got = run_lib.varied_configs(impl, (), {}, vary)
  # (1, 2) is the heuristics' own; (1, 5) changes one field of the two; a+c names no field c.
  assert got == [TwoFieldConfig(a=3, b=4), TwoFieldConfig(a=1, b=5), TwoFieldConfig(a=5, b=2)]


def test_varied_configs_leave_out_the_values_the_config_rejects():
  @dataclasses.dataclass(frozen=True)
  class BoundedConfig:
    a: int = 1

    def __post_init__(self):
      if self.a > 4:
        raise ValueError("a > 4")

  instance = types.SimpleNamespace(
    bind=lambda *a, **k: types.SimpleNamespace(args=None),
    _get_heuristics_config=lambda args: BoundedConfig(),
  )
  impl = types.SimpleNamespace(instance=instance)
  assert run_lib.varied_configs(impl, (), {}, {"a": [2, 8, 3]}) == [
    BoundedConfig(a=2),
    BoundedConfig(a=3),
  ]


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


@dataclasses.dataclass(frozen=True)
class _VaryConfig:
  a: int = 1


class _Impl:
  """An implementation as `bench.cases` lists it: a name, why it cannot run here, if so."""

  def __init__(self, name, reason=None, unsupported=None):
    self.name, self.reason, self._unsupported = name, reason, unsupported
    self.instance = types.SimpleNamespace(
      bind=lambda *a, **k: types.SimpleNamespace(args=None),
      _get_heuristics_config=lambda args: _VaryConfig(),
      with_config=lambda config: None,
    )

  def unsupported_reason(self, args, kwargs):
    if isinstance(self._unsupported, Exception):
      raise self._unsupported
    return self._unsupported


def _contender_keys(monkeypatch, impls, implementations, vary=None):
  """The keys of what `contenders` times for ragged_dot (anchors jax.lax, then xla), and its log."""
  monkeypatch.setattr(run_lib.cases_lib, "spec", lambda op: "spec")
  monkeypatch.setattr(run_lib.cases_lib, "anchors", lambda op: {"jax.lax": None, "numpy": None})
  bcase = types.SimpleNamespace(op="ragged_dot", id="case")
  log = []
  out = run_lib.contenders(
    bcase, impls, (), {}, implementations=implementations, sweep=False, log=log.append, vary=vary
  )
  return [c.key for c in out], log


def test_contenders_keep_the_anchors_and_skip_what_cannot_run(monkeypatch):
  impls = [
    _Impl("xla"),
    _Impl("triton", reason="no GPU"),
    _Impl("mosaic", unsupported=RuntimeError("boom")),
    _Impl("pallas"),
    _Impl("other"),
  ]
  # Everything that runs; --vary changes the implementations' configs, not the anchor's.
  keys, log = _contender_keys(monkeypatch, impls, None, vary={"a": [2]})
  assert keys == [
    "xla",
    "pallas",
    "pallas {'a': 2}",
    "other",
    "other {'a': 2}",
    run_lib.AUTO,
    "jax.lax",
    "numpy",
  ]
  assert any("SKIP ragged_dot[triton] case: no GPU" in line for line in log), log
  assert any("mosaic" in line and "RuntimeError: boom" in line for line in log), log
  # --impls pallas: the op's anchors (an implementation and a library call) still run.
  keys, _ = _contender_keys(monkeypatch, impls, ["pallas"])
  assert keys == ["xla", "pallas", "jax.lax"]
  # Nothing of the op runs: no implementation=None either, only the anchors outside it.
  keys, _ = _contender_keys(monkeypatch, impls[1:3], None)
  assert keys == ["jax.lax", "numpy"]


def test_time_case_drops_a_contender_that_does_not_compile_and_saves_the_hlo(monkeypatch, tmp_path):
  class Compiled(_Compiled):
    def memory_analysis(self):
      return types.SimpleNamespace(temp_size_in_bytes=64)

    def as_text(self):
      return f"optimised HLO of {self.name}"

  def compile_(bcase, c, args_list):
    if c.name == "b":
      raise RuntimeError("no lowering")
    return Compiled(c.name), [()]

  monkeypatch.setattr(run_lib, "_compile", compile_)
  monkeypatch.setattr(
    run_lib.timing,
    "device_time",
    lambda *a, **k: types.SimpleNamespace(median_ms=2.0, method="fake"),
  )
  contenders = [run_lib.Contender(name, fn=None) for name in ("a", "b", "c")]
  bcase = types.SimpleNamespace(op="op", id="case 1")
  log = []
  ran = run_lib.time_case(
    bcase, contenders, [()], rounds=1, iterations=1, warmup=1, log=log.append, hlo_dir=tmp_path
  )
  assert [(c.name, c.temp_bytes, c.rounds_ms) for c in ran] == [("a", 64, [2.0]), ("c", 64, [2.0])]
  assert contenders[1].error == "RuntimeError: no lowering"
  assert log == ["ERROR op[b] case 1: RuntimeError: no lowering"]
  assert sorted(p.name for p in tmp_path.iterdir()) == [
    "op-a-case_1.hlo.txt",
    "op-c-case_1.hlo.txt",
  ]
  assert (tmp_path / "op-c-case_1.hlo.txt").read_text() == "optimised HLO of c"


def _timed(name, rounds, temp_bytes=None):
  return run_lib.Contender(name, fn=None, rounds_ms=rounds, temp_bytes=temp_bytes)


def _records_of(monkeypatch, timed, op="layer_norm"):
  monkeypatch.setattr(run_lib.cases_lib, "anchors", lambda op: {"jnp": None})
  # Dimensions read back from JSON are lists, not tuples.
  shape = {"m": 8, "rows": [2, 3]}
  case = types.SimpleNamespace(feature="plain", id="c", shape_dict=shape, dtype="float32")
  bcase = types.SimpleNamespace(op=op, mode="fwd", case=case)
  recs = run_lib.case_records(bcase, timed, {"commit": "abc", "date": None}, "dev", None)
  return {r.implementation: r for r in recs}


def test_case_records_carry_the_anchors_rounds_and_memory(monkeypatch):
  timed = [
    _timed("xla", [4.0, 6.0, 5.0], temp_bytes=300),
    _timed("pallas", [2.0, 3.0, 1.0], temp_bytes=100),
    _timed("jnp", [8.0, 9.0, 7.0]),
  ]
  by_name = _records_of(monkeypatch, timed)
  assert set(by_name) == {"pallas", "jnp"}
  pallas = by_name["pallas"]
  assert (pallas.median_ms, pallas.anchor, pallas.anchor_ms) == (2.0, "xla", 5.0)
  assert pallas.extra["anchors_ms"] == {"xla": 5.0, "jnp": 8.0}
  assert pallas.extra["rounds_ms"] == [2.0, 3.0, 1.0]
  assert pallas.extra["anchor_rounds_ms"] == [4.0, 6.0, 5.0]
  assert (pallas.extra["temp_bytes"], pallas.extra["anchor_temp_bytes"]) == (100, 300)
  assert "temp_bytes" not in by_name["jnp"].extra
  assert pallas.shape == {"m": 8, "rows0": 2, "rows1": 3}


def test_a_case_where_only_the_anchor_ran_records_it_against_nothing(monkeypatch):
  by_name = _records_of(monkeypatch, [_timed("xla", [4.0, 6.0, 5.0])])
  (xla,) = by_name.values()
  assert (xla.implementation, xla.median_ms, xla.anchor, xla.anchor_ms) == ("xla", 5.0, None, None)
  assert xla.ratio is None and "anchor_rounds_ms" not in xla.extra


def test_none_is_not_held_to_a_slower_nondeterministic_implementation():
  """A training step where cuDNN (nondeterministic gradients) is slower than Mosaic: nothing is
  named beside Mosaic; where cuDNN alone ran, `None` has no rival at all."""
  plain = {
    name: run_lib.Contender(name, fn=None, rounds_ms=[ms])
    for name, ms in (("cudnn", 9.0), ("mosaic", 7.5))
  }
  got = run_lib._against_fastest("dot_product_attention", "fwd_bwd", plain, 8.0)
  assert got == {"fastest": "mosaic", "fastest_ms": 7.5, "ratio_to_fastest": 8.0 / 7.5}
  del plain["mosaic"]
  assert run_lib._against_fastest("dot_product_attention", "fwd_bwd", plain, 8.0) == {}


def test_run_keeps_within_the_budget_reuses_inputs_and_sinks_every_record(monkeypatch):
  """Three benchmark cases of --ops (two modes of c1, then c2) over a 10 s budget, the clock
  reading 0, 5 and 20 s before each: c2 is skipped; c1's inputs are made once, one set per
  rotation (keys folded from the case's), and the sink gets all records so far after each case;
  a case of another op is not run."""
  clock = iter([0.0, 0.0, 5.0, 20.0])
  monkeypatch.setattr(run_lib, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))
  monkeypatch.setattr(run_lib.bench_lib, "environment", lambda: {"commit": "c", "date": None})
  monkeypatch.setattr(run_lib.cases_lib, "implementations", lambda op, profile: [])
  monkeypatch.setattr(run_lib.cases_lib, "case_key", lambda case: jax.random.key(7))
  made = []

  def make_args(key):
    made.append(key)
    return (len(made),), {}

  def cost(args, kwargs):
    raise ValueError("no cost model")

  c1 = types.SimpleNamespace(id="c1", make_args=make_args, cost=cost)
  c2 = types.SimpleNamespace(id="c2", make_args=make_args, cost=cost)
  other = types.SimpleNamespace(op="other", id="c0 fwd", case=c2, mode="fwd")  # Not in --ops.
  bcases = [other] + [
    types.SimpleNamespace(op="op", id=f"{c.id} {m}", case=c, mode=m)
    for c, m in ((c1, "fwd"), (c1, "fwd_bwd"), (c2, "fwd"))
  ]
  monkeypatch.setattr(run_lib.cases_lib, "bench_cases", lambda family: bcases)
  monkeypatch.setattr(run_lib, "contenders", lambda *a, **k: [])
  seen = []

  def time_case(bcase, todo, args_list, **kwargs):
    seen.append((bcase.id, [a for a, _ in args_list]))
    return []

  def case_records(bcase, timed, env, device, cost):
    assert cost is None
    return [records.from_dict(_record(bcase))]

  monkeypatch.setattr(run_lib, "time_case", time_case)
  monkeypatch.setattr(run_lib, "case_records", case_records)
  sunk, log = [], []
  out = run_lib.run(
    "fam",
    ops=["op"],
    rotations=3,
    budget_s=10.0,
    log=log.append,
    sink=lambda rs: sunk.append(list(rs)),
  )
  assert [r.case for r in out] == ["c1 fwd", "c1 fwd_bwd"]
  assert seen == [("c1 fwd", [(1,), (2,), (3,)]), ("c1 fwd_bwd", [(1,), (2,), (3,)])]
  expected_keys = [jax.random.fold_in(jax.random.key(7), i) for i in range(3)]
  assert len(made) == 3
  for key, expected in zip(made, expected_keys, strict=True):
    assert (jax.random.key_data(key) == jax.random.key_data(expected)).all()
  assert [[r.case for r in rs] for rs in sunk] == [["c1 fwd"], ["c1 fwd", "c1 fwd_bwd"]]
  assert log[-1] == "SKIP op c2 fwd: past the 10 s budget"


def _record(bcase) -> dict:
  return {
    "device": "cpu",
    "commit": "c",
    "date": None,
    "op": bcase.op,
    "implementation": "x",
    "case": bcase.id,
    "shape": {},
    "dtype": "float32",
    "mode": bcase.mode,
    "median_ms": 1.0,
    "extra": {},
  }


def test_main_passes_its_options_and_writes_the_note(monkeypatch, tmp_path):
  out = tmp_path / "r.json"
  got = {}

  def fake_run(family, **kwargs):
    got.update(kwargs, family=family)
    bcase = types.SimpleNamespace(op="op", id="c", mode="fwd")
    recs = [records.from_dict(_record(bcase))]
    kwargs["sink"](recs)
    return recs

  monkeypatch.setattr(run_lib, "run", fake_run)
  argv = ["--family", "h100", "--impls", "a,,b", "--rounds", "3", "--iterations", "7"]
  argv += ["--warmup", "2", "--rotations", "4", "--budget-s", "60", "--kernels"]
  argv += ["--out", str(out), "--note", "what it shows"]
  assert run_lib.main(argv) == 0
  assert got["family"] == "h100" and got["implementations"] == ["a", "b"]
  assert (got["rounds"], got["iterations"], got["warmup"], got["rotations"]) == (3, 7, 2, 4)
  assert (got["budget_s"], got["kernels"], got["sweep"]) == (60.0, True, False)
  assert records.note(str(out)) == "what it shows" and len(records.load(str(out))) == 1
  monkeypatch.setattr(run_lib, "run", lambda family, **kwargs: [])
  assert run_lib.main(["--family", "h100"]) == 1


@pytest.mark.parametrize("backend", ["gpu", "cpu"])
def test_kernels_adds_the_per_kernel_breakdown_on_gpu_only(monkeypatch, backend):
  """`--kernels` (GPU only): on a GPU every contender that ran gets its per-kernel times,
  taken on its call arguments (one rotation here: `--rotations 1`); elsewhere none is asked."""
  asked = []

  def fake_kernels(compiled, args):
    asked.append((compiled.name, args))
    return [["fusion", 0.5], ["gemm", 1.5]]

  monkeypatch.setattr(run_lib, "_compile", lambda bcase, c, a: (_Compiled(c.name), [("x",)]))
  monkeypatch.setattr(
    run_lib.timing,
    "device_time",
    lambda *a, **k: types.SimpleNamespace(median_ms=2.0, method="fake"),
  )
  monkeypatch.setattr(run_lib, "per_kernel_ms", fake_kernels)
  monkeypatch.setattr(run_lib.jax, "default_backend", lambda: backend)
  contenders = [run_lib.Contender(name, fn=None) for name in ("a", "b")]
  bcase = types.SimpleNamespace(op="op", id="case")
  log = []
  ran = run_lib.time_case(
    bcase, contenders, [()], rounds=1, iterations=1, warmup=1, log=log.append, kernels=True
  )
  assert [c.name for c in ran] == ["a", "b"] and not log, log
  if backend == "gpu":
    assert asked == [("a", ("x",)), ("b", ("x",))]
    assert all(c.kernels_ms == [["fusion", 0.5], ["gemm", 1.5]] for c in ran)
  else:
    assert asked == [] and all(c.kernels_ms is None for c in ran)
