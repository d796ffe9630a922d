"""bench.trial: false alarms counted, planted slowdowns caught, small changes let through."""

import itertools
import json

from bench import records, trial


def _records(ms_by_op, run):
  return [
    {
      "op": op,
      "implementation": "xla",
      "case": "c",
      "shape_key": "n=1",
      "shapes": {"n": 1, "rows": (2, 3)},
      "dtype": "float32",
      "mode": "fwd",
      "device_kind": "cpu",
      "device_time_method": "wallclock",
      "device_time_median_ms": ms,
      "device_time_min_ms": ms * 0.98,
      "drift_ok": True,
      "run_id": f"r{run}",
      "commit": f"c{run}",
      "date": f"2000-01-01T00:00:{run:02d}+00:00",
    }
    for op, ms in ms_by_op.items()
  ]


def _measure(noise):
  runs = itertools.count()

  def measure():
    i = next(runs)
    jitter = noise[i % len(noise)]
    return _records({"layer_norm": 1.0 * jitter, "ragged_dot": 2.0 * jitter}, i)

  return measure


def test_quiet_measurements_give_no_false_alarm_and_catch_the_planted_slowdown():
  result = trial.trial(
    _measure((1.0, 1.01, 0.99, 1.005)), baseline=4, runs=6, op="layer_norm", slow=0.2, small=0.03
  )
  runs = result["runs"]
  assert len(runs) == 6
  assert all(r["false_alarms"] == 0 for r in runs)
  assert all(r["layer_norm_slowed_flagged"] == r["layer_norm_measurements"] == 1 for r in runs)
  assert all(r["layer_norm_small_change_flagged"] == 0 for r in runs)
  assert "0 of 12 measurements flagged" in trial.summary(result)


def test_a_real_slowdown_in_the_runs_counts_as_an_alarm():
  slow_after_baseline = (1.0, 1.0, 1.0, 1.0, 1.5)
  result = trial.trial(
    _measure(slow_after_baseline), baseline=4, runs=1, op="layer_norm", slow=0.2, small=0.03
  )
  assert result["runs"][0]["false_alarms"] == 2


def test_planting_touches_one_op_only():
  recs = _records({"layer_norm": 1.0, "ragged_dot": 2.0}, 0)
  out = trial.planted(recs, "layer_norm", 1.2)
  assert [r["device_time_median_ms"] for r in out] == [1.2, 2.0]
  assert recs[0]["device_time_median_ms"] == 1.0  # The measured records are left alone.


def test_planting_scales_every_time_the_rule_reads():
  recs = _records({"layer_norm": 1.0}, 0)
  recs[0]["device_time_rounds_ms"] = [1.0, 2.0]
  (out,) = trial.planted(recs, "layer_norm", 1.5)
  assert out["device_time_rounds_ms"] == [1.5, 3.0]
  assert out["device_time_min_ms"] == 1.5 * 0.98
  assert out["device_time_method"] == "wallclock" and out["op"] == "layer_norm"


def test_replay_judges_recorded_runs(tmp_path, capsys):
  path = tmp_path / "records.jsonl"
  with open(path, "w") as f:
    for i, jitter in enumerate((1.0, 1.01, 0.99, 1.0, 1.005, 0.995)):
      for r in _records({"layer_norm": jitter, "ragged_dot": 2 * jitter}, i):
        f.write(json.dumps(r) + "\n")
  out = tmp_path / "trial.json"
  cited = tmp_path / "cpu" / "nightly_trial.json"
  argv = ["--replay", str(path), "--baseline", "3", "--op", "ragged_dot", "--out", str(out)]
  assert trial.main([*argv, "--results", str(cited)]) == 0
  result = json.loads(out.read_text())
  assert len(result["runs"]) == 3 and result["op"] == "ragged_dot"
  assert "0 of 6 measurements flagged" in capsys.readouterr().out
  # As bench.records records: per op, the median of its three judged runs and their flags.
  recs = {r.op: r for r in records.load(str(cited))}
  assert recs["ragged_dot"].median_ms == 2.0 and recs["ragged_dot"].extra["flagged"] == 0
  assert recs["layer_norm"].extra["run_medians_ms"] == [1.0, 1.005, 0.995]
  assert len(recs["layer_norm"].extra["baseline_medians_ms"]) == 3
  assert recs["layer_norm"].shape == {"n": 1, "rows": 6}  # Dimension tuples: their product.


def test_a_lasting_slowdown_joins_the_history_and_stops_being_flagged():
  # Three baseline runs at 1.0, then four at 1.5 (both ops). Each judged run is appended to the
  # history before the next is judged, as the nightly appends it: the fourth's baseline is
  # [1, 1, 1, 1.5, 1.5, 1.5], median 1.25 and spread 1.4826 x 0.25 / 1.25 = 0.30, so its limit
  # is 3 x 0.30 = 90% and 1.5 passes; the first three see a baseline median of 1.0 with no spread.
  lasting = (1.0, 1.0, 1.0, 1.5, 1.5, 1.5, 1.5)
  result = trial.trial(_measure(lasting), baseline=3, runs=4, op="layer_norm", slow=0.2, small=0.03)
  assert [r["false_alarms"] for r in result["runs"]] == [2, 2, 2, 0]
  # Each measured thing counts its flags over all the judged runs.
  assert sorted(s["flagged"] for s in result["series"].values()) == [3, 3]
  # The slowed and small-change counts are of the trial's op only (one measurement a run).
  assert [r["layer_norm_slowed_flagged"] for r in result["runs"]][:3] == [1, 1, 1]
  assert [r["layer_norm_small_change_flagged"] for r in result["runs"]][:3] == [1, 1, 1]


def test_results_take_the_median_of_the_judged_runs():
  # Judged runs at 1.0, 1.01, 1.05 (all within the 9% limit): median 1.01, mean 1.02.
  result = trial.trial(
    _measure((1.0, 1.0, 1.0, 1.0, 1.01, 1.05)),
    baseline=3,
    runs=3,
    op="layer_norm",
    slow=0.2,
    small=0.03,
  )
  recs = {r["op"]: r for r in trial.results(result)}
  assert recs["layer_norm"]["median_ms"] == 1.01
  assert recs["ragged_dot"]["median_ms"] == 2.02
  assert recs["layer_norm"]["extra"]["run_medians_ms"] == [1.0, 1.01, 1.05]
  # The case names the shape too: features of the same op at other shapes stay apart.
  assert recs["layer_norm"]["case"] == "n=1 c"


def test_summary_counts_runs_where_every_measurement_of_the_op_was_caught():
  runs = [
    {
      "false_alarms": 0,
      "measurements": 4,
      "layer_norm_slowed_flagged": caught,
      "layer_norm_measurements": 2,
      "layer_norm_small_change_flagged": 0,
    }
    for caught in (2, 1, 0)
  ]
  result = {"op": "layer_norm", "runs": runs, "baseline_runs": 5, "slow": 0.2, "small": 0.03}
  line = trial.summary(result)
  assert "0 of 12 measurements flagged" in line
  assert "every measurement of it flagged in 1 of 3 runs" in line


def test_replay_fails_on_a_false_alarm(tmp_path, capsys):
  # layer_norm slows by half in the last recorded run: a false alarm of a trial of ragged_dot.
  path = tmp_path / "records.jsonl"
  with open(path, "w") as f:
    for i, jitter in enumerate((1.0, 1.01, 0.99, 1.0, 1.5)):
      for r in _records({"layer_norm": jitter, "ragged_dot": 2.0}, i):
        f.write(json.dumps(r) + "\n")
  assert trial.main(["--replay", str(path), "--baseline", "3", "--op", "ragged_dot"]) == 1
  assert "1 of 4 measurements flagged" in capsys.readouterr().out


def test_the_small_change_is_planted_as_a_slowdown():
  # Three baseline runs at 1.0 (no spread): the CPU timer's 3% floor gives a limit of
  # 3 x 3% = 9%. The judged run at 1.07 passes; +3% on it (1.1021, its fastest 1.0801 past
  # 0.98 x 1.05) is past the limit and flagged, where -3% (1.0379) would pass.
  result = trial.trial(
    _measure((1.0, 1.0, 1.0, 1.07)), baseline=3, runs=1, op="layer_norm", slow=0.2, small=0.03
  )
  (run,) = result["runs"]
  assert run["false_alarms"] == 0
  assert run["layer_norm_small_change_flagged"] == 1
  assert run["layer_norm_slowed_flagged"] == 1


def test_a_measuring_trial_warns_of_cpu_timings_only_without_the_nightly_flags(monkeypatch, capsys):
  measure = _measure((1.0,))
  monkeypatch.setattr(trial.history, "run", lambda family, timer, log: measure())
  monkeypatch.setattr(trial.history, "default_timer", lambda iterations: None)
  for backend, flags, warned in (
    ("cpu", "", True),
    ("cpu", f"--xla_foo {trial.history.CPU_XLA_FLAGS}", False),
    ("gpu", "", False),
  ):
    monkeypatch.setattr(trial.jax, "default_backend", lambda backend=backend: backend)
    monkeypatch.setenv("XLA_FLAGS", flags)
    assert trial.main(["--baseline", "3", "--runs", "1"]) == 0
    out = capsys.readouterr().out
    assert ("multi-threaded CPU timings" in out) == warned, (backend, flags, out)
    assert "0 of 2 measurements flagged" in out


def test_replay_defaults_to_five_baseline_runs_and_ten_judged_runs(tmp_path):
  # The documented defaults (`[--baseline 5] [--runs 10]`): of 16 recorded runs, the first five
  # are the history and ten of the other eleven are judged.
  path = tmp_path / "records.jsonl"
  with open(path, "w") as f:
    for i in range(16):
      for r in _records({"layer_norm": 1.0, "ragged_dot": 2.0}, i):
        f.write(json.dumps(r) + "\n")
  out = tmp_path / "trial.json"
  assert trial.main(["--replay", str(path), "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  assert result["baseline_runs"] == 5
  assert [r["run"] for r in result["runs"]] == list(range(10))
  (s, _) = result["series"].values()
  assert len(s["baseline_medians_ms"]) == 5


def test_the_planted_slowdown_is_one_plus_slow():
  # Baseline runs at 0.8, 1.2, 0.8, 1.2: median 1.0 and spread 1.4826 x 0.2 / 1.0 = 0.30, so the
  # limit is 3 x 0.30 = 89%. The judged run at 1.0 slowed by 20% (1.2) passes; by 100% (2.0)
  # it is flagged.
  noisy = (0.8, 1.2, 0.8, 1.2, 1.0)
  for slow, caught in ((0.2, 0), (1.0, 1)):
    result = trial.trial(
      _measure(noisy), baseline=4, runs=1, op="layer_norm", slow=slow, small=0.03
    )
    (run,) = result["runs"]
    assert run["false_alarms"] == 0
    assert run["layer_norm_slowed_flagged"] == caught, slow
