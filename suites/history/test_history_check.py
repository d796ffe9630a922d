"""The regression check of `bench.history` on hand-made records: which runs form a record's
baseline, which records are compared at all, and the drift rule."""

import itertools
import statistics

import jax
import numpy as np
import pytest

from bench import history
from suites.history import rows
from tokamax_harness import timing


def _record(ms=1.0, run_id="now@2026", date="2026-12-02T00:00:00+00:00", **kw):
  return rows.history_row(ms, run_id, date, shapes={"m": 8, "d": 64}, **kw)


def _runs(mss, day0=1, **kw):
  """Earlier runs, one per median in `mss`, on consecutive days from `day0`."""
  return [
    _record(ms, run_id=f"r{day0 + i}@2000", date=f"2000-01-{day0 + i:02d}T00:00:00+00:00", **kw)
    for i, ms in enumerate(mss)
  ]


def _status(record, past, **kw):
  (row,) = history.check([record], past, **kw)
  return row


def test_the_baseline_is_the_latest_runs_of_the_window(tmp_path):
  # Ten old runs at 2 ms, then three recent ones at 1 ms, given out of date order.
  past = _runs([2.0] * 10) + _runs([1.0] * 3, day0=11)
  past = past[::-1][3:] + past[::-1][:3]
  row = _status(_record(1.1), past, window=3)
  assert row.status == "SLOWER" and row.baseline_ms == 1.0 and row.runs == 3, row
  row = _status(_record(1.1), past, window=13)
  assert row.status == "ok" and row.baseline_ms == 2.0 and row.runs == 13, row
  # Through the command line: --window reaches the check.
  hist, recs = tmp_path / "history.jsonl", tmp_path / "run.jsonl"
  history.append(past, str(hist))
  history.append([_record(1.1)], str(recs))
  argv = ["check", "--records", str(recs), "--history", str(hist)]
  assert history.main([*argv, "--window", "3"]) == 1
  assert history.main([*argv, "--window", "13"]) == 0


def test_a_runs_own_records_are_not_its_baseline(tmp_path, capsys):
  past = _runs([1.0, 1.0])
  now = _record(2.0, run_id="r9@2000", date="2000-01-09T00:00:00+00:00")
  row = _status(now, [*past, now])
  assert row.status == history.NO_BASELINE and row.runs == 2, row
  # `check` without --records checks the latest run of the history against the others.
  hist = tmp_path / "history.jsonl"
  history.append([*_runs([1.0, 1.0, 1.0]), now], str(hist))
  assert history.main(["check", "--history", str(hist)]) == 1
  out = capsys.readouterr().out
  assert "SLOWER" in out and "+100.0%" in out, out
  hist.unlink()
  history.append([now, *_runs([2.0, 1.0, 1.0], day0=10)], str(hist))  # The latest: 1 ms.
  assert history.main(["check", "--history", str(hist)]) == 0


@pytest.mark.parametrize(
  "field, value",
  [
    ("device_kind", "NVIDIA H200"),
    ("host", "another host x64"),
    ("device_time_method", "cupti"),
    ("op", "ragged_dot"),
    ("implementation", "triton"),
    ("case", "rms"),
    ("shape_key", "d=64,m=16"),
    ("dtype", "bfloat16"),
    ("mode", "fwd_bwd"),
  ],
)
def test_records_of_another_identity_are_new(field, value, tmp_path):
  past = _runs([1.0] * 5)
  row = _status(_record(3.0, **{field: value}), past)
  assert row.status == "new" and not row.failed and row.runs == 0, row
  assert _status(_record(3.0), past).status == "SLOWER"
  # A new measurement passes the command line's check.
  hist, recs = tmp_path / "history.jsonl", tmp_path / "run.jsonl"
  history.append(past, str(hist))
  history.append([_record(3.0, **{field: value})], str(recs))
  assert history.main(["check", "--records", str(recs), "--history", str(hist)]) == 0


def test_the_shape_key_is_made_from_the_shapes_where_missing():
  assert history.shape_key({"m": 8, "d": [64, 2]}) == "d=64x2,m=8"
  past = [{k: v for k, v in r.items() if k != "shape_key"} for r in _runs([1.0] * 3)]
  assert _status(_record(1.2), past).status == "SLOWER"


def test_drift_grows_by_more_than_the_margin():
  """DRIFT: past tolerance where the baseline was not, or grown by more than one bound."""
  within = _runs([1.0] * 3, drift_ratio=0.1, drift_ok=True)
  assert _status(_record(drift_ratio=0.9), within).status == "ok"
  assert _status(_record(drift_ratio=1.3, drift_ok=False), within).status == "DRIFT"
  assert _status(_record(drift_ratio=0.9), within, drift_margin=0.5).status == "DRIFT"
  # A baseline already past tolerance: only growing by more than the margin is DRIFT.
  past_tol = _runs([1.0] * 3, drift_ratio=2.0, drift_ok=False)
  assert _status(_record(drift_ratio=2.5, drift_ok=False), past_tol).status == "ok"
  row = _status(_record(1.2, drift_ratio=3.5, drift_ok=False), past_tol)
  assert row.status == "SLOWER+DRIFT" and row.baseline_drift == 2.0, row


def _anchored(ms, anchor_ms, anchor="jnp", rounds=10, **kw):
  return dict(
    kw,
    device_time_median_ms=ms,
    device_time_rounds_ms=[ms] * rounds,
    anchor=anchor,
    anchor_rounds_ms=[anchor_ms] * rounds,
  )


def test_the_anchor_rule_compares_like_anchors_only():
  # The host slowed the op and its anchor alike: not a regression.
  past = [_anchored(1.0, 0.5) for _ in range(3)]
  assert not history.verdict(_anchored(1.2, 0.6), past).slower
  # The baseline's ratios are to another anchor: the median alone decides.
  assert history.verdict(_anchored(1.2, 0.6, anchor="jax.nn"), past).slower
  # Anchor rounds that do not pair up with the op's give no ratios: the median decides.
  uneven = _anchored(1.2, 0.6)
  uneven["anchor_rounds_ms"] = uneven["anchor_rounds_ms"][:-1]
  assert history.verdict(uneven, past).slower


def test_records_without_rounds_compare_with_the_median_fastest_sample():
  past = [
    {"device_time_median_ms": 1.0, "device_time_min_ms": f} for f in (0.8, 0.9, 0.9, 0.9, 0.95)
  ]
  # 0.93 is within 5% of the baseline runs' median fastest (0.9), past their least (0.8).
  assert not history.verdict(
    {"device_time_median_ms": 1.2, "device_time_min_ms": 0.93}, past
  ).slower
  assert history.verdict({"device_time_median_ms": 1.2, "device_time_min_ms": 0.96}, past).slower


def test_the_noise_of_a_records_rounds_is_the_standard_error_of_their_median():
  rounds = [0.7, 0.8, 0.9, 1.0, 1.1, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 0.6, 1.05, 0.95, 1.25, 0.85]
  rec = {"device_time_median_ms": 1.0, "device_time_rounds_ms": rounds}
  med = float(np.median(rounds))
  sigma = 1.4826 * float(np.median(np.abs(np.asarray(rounds) - med))) / med
  expected = 1.2533 * sigma / np.sqrt(len(rounds))
  assert history.noise(rec, [1.0, 1.0, 1.0]) == pytest.approx(expected, rel=1e-9)
  # Under MIN_RUNS rounds: no standard error; the timer's floor where it has one.
  assert history.noise({"device_time_rounds_ms": [1.0, 2.0]}, [1.0, 1.0, 1.0]) == 0.0
  floor = history.noise({"device_time_method": "wallclock"}, [1.0, 1.0, 1.0])
  assert floor == history.NOISE_FLOOR["wallclock"]
  assert history.noise({}, [0.9, 1.0, 1.2]) == pytest.approx(
    1.4826 * statistics.median([0.1, 0.0, 0.2]) / 1.0
  )


def test_ingest_keeps_a_known_commit(tmp_path):
  src, dst = tmp_path / "run.jsonl", tmp_path / "history.jsonl"
  known = _record(run_id="feedbeef@2001")
  unknown = _record(run_id="unknown@2002", implementation="triton", commit="unknown")
  history.append([known, unknown], str(src))
  assert history.main(["ingest", "--history", str(dst), "--commit", "abc123", str(src)]) == 0
  by_impl = {r["implementation"]: r for r in history.load(str(dst))}
  assert by_impl["xla"]["commit"] == "feedbeef" and by_impl["xla"]["run_id"] == "feedbeef@2001"
  assert by_impl["triton"]["commit"] == "abc123" and by_impl["triton"]["run_id"] == "abc123@2002"


def test_append_keeps_another_runs_record_of_the_same_thing(tmp_path):
  path = str(tmp_path / "history.jsonl")
  assert history.append([_record(run_id="a@1")], path) == 1
  assert history.append([_record(run_id="a@1"), _record(run_id="b@2")], path) == 1
  assert [r["run_id"] for r in history.load(path)] == ["a@1", "b@2"]


def test_run_keeps_the_rates_at_the_median_of_round_medians():
  """A record's time is the median of its round medians and its rates are at that time
  (rounds whose samples are skewed pool to another median); `features` restricts the cases."""
  calls = itertools.count()

  def timer(fn, args_list):
    jax.block_until_ready(fn(*args_list[0]))
    ms = 1.0 + 0.1 * (next(calls) % 7)
    return timing.Timing((ms * 1e-3, ms * 1e-3, 5 * ms * 1e-3), "fake")

  run = lambda features: history.run(
    "cpu",
    ops=["layer_norm"],
    implementations=["xla"],
    features=features,
    modes=["fwd"],
    timer=timer,
    rounds=6,
    log=lambda _: None,
  )
  assert run(["no_such_feature"]) == []
  recs = run(["plain"])
  assert recs and all(r["case"] == "plain" for r in recs)
  for r in recs:
    rounds = r["device_time_rounds_ms"]
    assert len(rounds) == 6 and r["device_time_median_ms"] == statistics.median(rounds)
    # layer_norm's cost model: x read and the output written, float32.
    rows, d = np.prod(r["shapes"]["rows"]), r["shapes"]["d"]
    gb = 2 * rows * d * 4 / 1e9
    assert r["gb_per_s"] == pytest.approx(gb / (r["device_time_median_ms"] * 1e-3), rel=1e-9)
    anchor = r["anchor_rounds_ms"]
    assert len(anchor) == 6 and r["anchor_median_ms"] == statistics.median(anchor)


def test_a_baseline_with_one_run_past_tolerance_is_not_clean():
  """One baseline run already past tolerance: a record past it is DRIFT only by the margin."""
  mixed = _runs([1.0] * 2, drift_ratio=0.5) + _runs([1.0], day0=3, drift_ratio=0.5, drift_ok=False)
  assert _status(_record(drift_ratio=1.2, drift_ok=False), mixed).status == "ok"
  assert _status(_record(drift_ratio=1.6, drift_ok=False), mixed).status == "DRIFT"
  clean = _runs([1.0] * 3, drift_ratio=0.5)
  assert _status(_record(drift_ratio=1.2, drift_ok=False), clean).status == "DRIFT"


def test_the_baseline_drift_is_the_median_of_the_runs():
  """Drift ratios 0.1, 0.2 and 3.0: the baseline is 0.2 (the mean, 1.1, would hide 1.5)."""
  past = [dict(r, drift_ratio=d) for r, d in zip(_runs([1.0] * 3), (0.1, 0.2, 3.0), strict=True)]
  row = _status(_record(drift_ratio=1.5), past)
  assert row.status == "DRIFT" and row.baseline_drift == pytest.approx(0.2), row
  assert _status(_record(drift_ratio=1.1), past).status == "ok"


def test_the_anchor_ratio_is_judged_within_the_ratios_noise():
  """Baseline ratios 0.4, 0.5, 0.6 (spread 1.4826 x 0.1 / 0.5): the limit is 3 x 0.2965 = 89%,
  so a ratio of 0.75 (50% up, past the 5% threshold) is noise and 1.0 (100% up) is not."""
  past = [_anchored(1.0, 1.0 / r) for r in (0.4, 0.5, 0.6)]
  assert history.verdict(_anchored(1.5, 1.5), past).slower  # The median alone: 50% slower.
  assert not history.verdict(_anchored(1.5, 2.0), past).slower  # Ratio 0.75.
  assert history.verdict(_anchored(1.5, 1.5 / 0.96), past).slower  # Ratio 0.96 > 0.945.


def test_the_rounds_rule_only_confirms_a_slower_median():
  """Baseline medians 0.8, 1.0, 1.2 (limit 3 x 29.65%): every round at 1.1 is within it, though
  past the 5% threshold; the rounds rule does not make it slower."""
  past = [{"device_time_median_ms": m} for m in (0.8, 1.0, 1.2)]
  record = {"device_time_median_ms": 1.1, "device_time_rounds_ms": [1.1] * 10}
  v = history.verdict(record, past)
  assert v.limit == pytest.approx(3 * 1.4826 * 0.2) and not v.slower, v
  record = {"device_time_median_ms": 2.0, "device_time_rounds_ms": [2.0] * 10}
  assert history.verdict(record, past).slower
