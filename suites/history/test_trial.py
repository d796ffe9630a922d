"""bench.trial: false alarms counted, planted slowdowns caught, small changes let through."""

import itertools

from bench import trial


def _records(ms_by_op, run):
  return [
    {
      "op": op,
      "implementation": "xla",
      "case": "c",
      "shape_key": "n=1",
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
