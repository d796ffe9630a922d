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
