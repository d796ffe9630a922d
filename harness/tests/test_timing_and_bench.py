"""Timers and benchmark records against a fake clock and hand-computed rates.

A fake clock that the timed function itself advances gives known per-run
times: the timer must rotate through the argument tuples, time each run and
nothing else, honour `min_seconds` up to its cap, and keep the reason of a
CUPTI fallback. A `Measurement` of known FLOPs, bytes and times must report
the rates of its median time.
"""

import dataclasses
import datetime
import json
import subprocess
import types
import warnings

import jax
import pytest

from tokamax_harness import bench, hardware, timing


class FakeClock:
  """A clock that only the timed function (and each reading, by `tick`) moves."""

  def __init__(self, tick: float = 0.0):
    self.now = 0.0
    self.tick = tick

  def __call__(self) -> float:
    self.now += self.tick
    return self.now


def test_wallclock_times_rotates_the_arguments_and_times_each_run():
  clock = FakeClock()
  seen = []

  def fn(seconds):
    seen.append(seconds)
    clock.now += seconds  # The run takes `seconds` on the fake clock.

  times = timing.wallclock_times(fn, [(1.0,), (2.0,), (4.0,)], 5, clock=clock)
  assert seen == [1.0, 2.0, 4.0, 1.0, 2.0]
  assert times == [1.0, 2.0, 4.0, 1.0, 2.0]


def test_timing_summary_of_known_times():
  t = timing.Timing((0.004, 0.001, 0.010, 0.002), "wallclock")
  assert t.median_s == pytest.approx(0.003)
  d = t.as_dict()
  assert d["median_ms"] == pytest.approx(3.0)
  assert d["min_ms"] == pytest.approx(1.0)
  assert d["max_ms"] == pytest.approx(10.0)
  assert d["runs"] == 4 and d["method"] == "wallclock" and d["fallback_reason"] is None


@pytest.mark.parametrize("method", [timing.WALLCLOCK, timing.CPUTIME])
def test_min_seconds_asks_for_more_iterations_up_to_the_cap(monkeypatch, method):
  clock = FakeClock(tick=0.005)  # Each reading 5 ms later: a warm-up run "takes" 5 ms.
  monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=clock, process_time=clock))
  fn = lambda: None
  assert len(timing.device_time(fn, [()], iterations=4, method=method).times_s) == 4
  # 1 s of 5 ms calls: 200 iterations, more than the 4 asked for.
  out = timing.device_time(fn, [()], iterations=4, method=method, min_seconds=1.0)
  assert len(out.times_s) == 200 and out.method == method
  # Never fewer than asked for ...
  assert (
    len(timing.device_time(fn, [()], iterations=300, method=method, min_seconds=1.0).times_s) == 300
  )
  # ... and at most MAX_ITERATIONS = 2000 (1000 s would be 200000 calls).
  assert (
    len(timing.device_time(fn, [()], iterations=4, method=method, min_seconds=1e3).times_s) == 2000
  )


def test_cupti_fallback_keeps_its_reason(monkeypatch):
  monkeypatch.setattr(timing, "cupti_times", lambda *args: None)  # As where CUPTI cannot load.
  with pytest.warns(UserWarning, match="fell back to wallclock") as caught:
    out = timing.device_time(lambda: None, [()], warmup=1, iterations=3, method=timing.CUPTI)
  # The warning points at the caller of device_time (this file), not at timing.py or above.
  assert [w.filename for w in caught] == [__file__]
  assert out.method == timing.WALLCLOCK and len(out.times_s) == 3
  assert out.fallback_reason == "CUPTI is unavailable here"
  assert out.as_dict()["fallback_reason"] == "CUPTI is unavailable here"

  def broken(*args):
    raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

  monkeypatch.setattr(timing, "cupti_times", broken)
  with pytest.warns(UserWarning, match="CUPTI_ERROR_NOT_INITIALIZED"):
    out = timing.device_time(lambda: None, [()], warmup=1, iterations=2, method=timing.CUPTI)
  assert out.fallback_reason == "RuntimeError: CUPTI_ERROR_NOT_INITIALIZED"


def test_device_time_rejects_unknown_methods_and_empty_arguments():
  with pytest.raises(ValueError, match="unknown timing method"):
    timing.device_time(lambda: None, [()], warmup=1, method="xprof")
  with pytest.raises(ValueError, match="args_list"):
    timing.device_time(lambda: None, [])


@dataclasses.dataclass(frozen=True)
class _Cost:
  flops: float
  bytes: float


def _measurement(mode: str) -> bench.Measurement:
  # Median 2 s (min 1 s, max 8 s); 6 TFLOP and 4 GB of forward work.
  times = timing.Timing((1.0, 2.0, 8.0), "wallclock")
  return bench.measurement(
    op="layer_norm",
    implementation="xla",
    case="plain",
    mode=mode,
    shapes={"m": 8},
    dtype="float32",
    result=times,
    cost=_Cost(flops=6e12, bytes=4e9),
  )


def test_measurement_rates_use_the_median_time():
  m = _measurement("fwd")
  assert (m.flops, m.bytes) == (6e12, 4e9)
  assert m.tflops == pytest.approx(3.0)  # 6e12 FLOP / 2 s.
  assert m.gbps == pytest.approx(2.0)  # 4e9 B / 2 s.
  d = m.as_dict()
  assert d["tflops_per_s"] == pytest.approx(3.0) and d["gb_per_s"] == pytest.approx(2.0)
  assert d["device_time_median_ms"] == pytest.approx(2000.0)
  assert d["device_time_min_ms"] == pytest.approx(1000.0)
  assert d["device_time_max_ms"] == pytest.approx(8000.0)
  assert d["mode"] == "fwd" and d["op"] == "layer_norm" and d["shapes"] == {"m": 8}


def test_forward_and_backward_count_three_forwards_of_work():
  m = _measurement("fwd_bwd")
  assert (m.flops, m.bytes) == (18e12, 12e9)
  assert m.tflops == pytest.approx(9.0) and m.gbps == pytest.approx(6.0)


def test_measurement_without_a_cost_has_no_rates():
  m = bench.measurement(
    op="x",
    implementation="y",
    case="z",
    mode="fwd",
    shapes={},
    dtype="float32",
    result=timing.Timing((1.0,), "wallclock"),
  )
  assert m.flops is None and m.tflops is None and m.gbps is None


def test_current_commit_prefers_github_sha(monkeypatch):
  """A device copy of the tree may carry a stale .git: the CI's GITHUB_SHA wins."""
  monkeypatch.setenv("GITHUB_SHA", "0123abcd" * 5)
  assert bench.current_commit() == "0123abcd" * 5
  assert bench.environment()["commit"] == "0123abcd" * 5


def test_write_json_stores_records_with_their_environment(tmp_path, monkeypatch):
  monkeypatch.setenv("GITHUB_SHA", "f" * 40)
  path = tmp_path / "out" / "bench.json"
  doc = bench.write_json(str(path), [_measurement("fwd"), {"op": "hand-written"}], run="nightly")
  on_disk = json.loads(path.read_text())
  assert on_disk == json.loads(json.dumps(doc, default=str))
  assert on_disk["commit"] == "f" * 40 and on_disk["run"] == "nightly"
  assert [r["op"] for r in on_disk["records"]] == ["layer_norm", "hand-written"]
  assert on_disk["records"][0]["tflops_per_s"] == pytest.approx(3.0)


def test_cupti_times_spread_runs_over_the_arguments_in_seconds(monkeypatch):
  """CUPTI reports milliseconds per run; the timing is in seconds, runs split over the tuples."""
  from tokamax._src import benchmarking

  calls = []

  def fake_cupti(fn, args, iterations):
    calls.append((args, iterations))
    return [2.0] * iterations  # 2 ms per run.

  monkeypatch.setattr(benchmarking, "cupti_unavailable_reason", lambda: None)
  monkeypatch.setattr(benchmarking, "cupti_times", fake_cupti)
  out = timing.device_time(lambda x: x, [(1,), (2,), (3,)], warmup=1, iterations=30, method="cupti")
  assert out.method == timing.CUPTI and out.fallback_reason is None
  assert calls == [((1,), 10), ((2,), 10), ((3,), 10)]
  assert out.times_s == pytest.approx((0.002,) * 30)
  # Fewer iterations than argument tuples: still one run of each.
  out = timing.device_time(lambda x: x, [(1,), (2,), (3,)], warmup=1, iterations=2, method="cupti")
  assert len(out.times_s) == 3


@pytest.mark.parametrize(("warmup", "runs"), [(3, 3), (0, 1)])
def test_warmup_runs_are_run_and_not_timed(warmup, runs):
  """`warmup` untimed runs (at least one, for compilation), then `iterations` timed ones."""
  calls = []
  out = timing.device_time(
    lambda: calls.append(1), [()], warmup=warmup, iterations=4, method=timing.WALLCLOCK
  )
  assert len(calls) == runs + 4 and len(out.times_s) == 4


def test_device_time_defaults_to_three_warmup_runs_and_thirty_timed():
  """The signature's defaults: warmup=3 untimed runs, then iterations=30 timed ones."""
  calls = []
  out = timing.device_time(lambda: calls.append(1), [()], method=timing.WALLCLOCK)
  assert len(calls) == 3 + 30 and len(out.times_s) == 30


def test_auto_is_wallclock_off_gpu_and_cupti_on_gpu(monkeypatch):
  monkeypatch.setattr(timing.jax, "default_backend", lambda: "cpu")
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # No CUPTI attempt, no fallback warning.
    out = timing.device_time(lambda: None, [()], warmup=1, iterations=3)
  assert out.method == timing.WALLCLOCK and out.fallback_reason is None
  assert len(out.times_s) == 3
  monkeypatch.setattr(timing.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(timing, "cupti_times", lambda fn, args_list, n: [1e-3] * n)
  out = timing.device_time(lambda: None, [()], warmup=1, iterations=3)
  assert out.method == timing.CUPTI and out.times_s == (1e-3,) * 3


def test_cputime_reads_the_process_clock(monkeypatch):
  """Each reading of the wall clock moves it 1 s, of the process clock 0.25 s."""
  wall, cpu = FakeClock(tick=1.0), FakeClock(tick=0.25)
  monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=wall, process_time=cpu))
  fn = lambda: None
  out = timing.device_time(fn, [()], warmup=1, iterations=3, method=timing.CPUTIME)
  assert out.times_s == (0.25,) * 3 and out.method == timing.CPUTIME
  out = timing.device_time(fn, [()], warmup=1, iterations=3, method=timing.WALLCLOCK)
  assert out.times_s == (1.0,) * 3 and out.method == timing.WALLCLOCK


def test_record_adds_to_the_benchmark_extra_info():
  """The fixture's own extra_info stays; the record's fields join it."""
  fixture = types.SimpleNamespace(extra_info={"set_by_the_test": 1})
  info = bench.record(fixture, _measurement("fwd"))
  assert fixture.extra_info["set_by_the_test"] == 1
  assert fixture.extra_info["tflops_per_s"] == pytest.approx(3.0)
  assert fixture.extra_info["device_time_median_ms"] == pytest.approx(2000.0)
  assert info["gb_per_s"] == pytest.approx(2.0)
  assert bench.record(None, _measurement("fwd"))["op"] == "layer_norm"


def test_a_record_names_its_implementation_case_and_device(monkeypatch):
  h100 = hardware.Profile(
    platform="gpu",
    device_kind="NVIDIA H100 80GB HBM3",
    family="h100",
    compute_capability=(9, 0),
    memory_bytes=None,
    device_count=1,
    has_f64=True,
    runnable=frozenset({"xla"}),
  )
  monkeypatch.setattr(bench.hardware, "detect", lambda: h100)
  d = _measurement("fwd_bwd").as_dict()
  assert (d["op"], d["implementation"], d["case"], d["mode"], d["dtype"]) == (
    "layer_norm",
    "xla",
    "plain",
    "fwd_bwd",
    "float32",
  )
  assert (d["device_kind"], d["family"]) == ("NVIDIA H100 80GB HBM3", "h100")
  assert (d["flops"], d["bytes"]) == (18e12, 12e9)


def test_runs_counts_repeated_times():
  """Three runs of which two took the same 1 ms: 3 runs, median 1 ms."""
  d = timing.Timing((0.001, 0.002, 0.001), "wallclock").as_dict()
  assert d["runs"] == 3
  assert d["median_ms"] == pytest.approx(1.0)


def test_cupti_times_is_none_where_cupti_cannot_load(monkeypatch):
  """tokamax says why CUPTI is unavailable: no CUPTI run is attempted, the caller falls back."""
  from tokamax._src import benchmarking

  def never(*args):
    raise AssertionError("CUPTI was run although it is unavailable")

  monkeypatch.setattr(benchmarking, "cupti_unavailable_reason", lambda: "no NVIDIA GPU")
  monkeypatch.setattr(benchmarking, "cupti_times", never)
  assert timing.cupti_times(lambda: None, [()], 4) is None
  with pytest.warns(UserWarning, match="CUPTI is unavailable here"):
    out = timing.device_time(lambda: None, [()], warmup=1, iterations=2, method=timing.CUPTI)
  assert out.method == timing.WALLCLOCK and out.fallback_reason == "CUPTI is unavailable here"


def test_a_bare_argument_is_one_argument():
  """args_list items that are not tuples are single arguments (an array is not unpacked)."""
  seen = []
  row = [1.0, 2.0, 3.0]
  timing.device_time(lambda x: seen.append(x), [row], warmup=1, iterations=2, method="wallclock")
  assert seen == [row] * 3


@pytest.mark.parametrize(
  "error",
  [
    subprocess.CalledProcessError(128, ["git"], stderr="not a git repository"),
    subprocess.TimeoutExpired(["git"], 10),
    FileNotFoundError("git"),
  ],
)
def test_current_commit_is_unknown_where_git_fails(monkeypatch, error):
  """No GITHUB_SHA and no usable git (not a repository, hung, not installed): "unknown"."""
  monkeypatch.delenv("GITHUB_SHA", raising=False)

  def run(*args, **kwargs):
    raise error

  monkeypatch.setattr(bench.subprocess, "run", run)
  assert bench.current_commit() == "unknown"


def test_current_commit_is_gits_head_without_its_newline(monkeypatch):
  monkeypatch.delenv("GITHUB_SHA", raising=False)

  def run(args, **kwargs):
    assert args == ["git", "rev-parse", "HEAD"]
    return types.SimpleNamespace(stdout="0123abcd" * 5 + "\n")

  monkeypatch.setattr(bench.subprocess, "run", run)
  assert bench.current_commit() == "0123abcd" * 5


def _git(cwd, *args):
  subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def test_current_commit_runs_git_for_the_head_of_the_working_directory(tmp_path, monkeypatch):
  """With a real git (nothing faked): the hash that .git's branch ref holds, as a str."""
  monkeypatch.delenv("GITHUB_SHA", raising=False)
  monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
  _git(tmp_path, "init", "-q", "-b", "main")
  _git(
    tmp_path,
    "-c",
    "user.name=t",
    "-c",
    "user.email=t@t",
    "commit",
    "-q",
    "--allow-empty",
    "-m",
    "x",
  )
  head = (tmp_path / ".git" / "refs" / "heads" / "main").read_text().strip()
  assert len(head) == 40
  monkeypatch.chdir(tmp_path)
  assert bench.current_commit() == head


def test_current_commit_is_unknown_outside_a_repository(tmp_path, monkeypatch):
  """With a real git that fails (no repository here or above): "unknown", not an empty hash."""
  monkeypatch.delenv("GITHUB_SHA", raising=False)
  monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
  monkeypatch.chdir(tmp_path)
  assert bench.current_commit() == "unknown"


def test_environment_dates_in_utc_and_names_jax_and_the_hardware(monkeypatch):
  monkeypatch.setenv("GITHUB_SHA", "f" * 40)
  env = bench.environment()
  assert datetime.datetime.fromisoformat(env["date"]).utcoffset() == datetime.timedelta(0)
  assert env["jax_version"] == jax.__version__
  assert env["hardware"]["device_kind"] == jax.devices()[0].device_kind
