"""The GPU check script's helpers (ci/gpu/tooling.py) that run on a CPU.

Its timers and tuning need an NVIDIA GPU; what is checked here is its plumbing: the
section wrapper's record, and that its benchmark functions take the shapes they name
(at full size abstractly, since a shape mismatch only shows when they trace) and the
small ones of `--dry`.
"""

import json
import math
import sys

import jax
import pytest

import tokamax
from ci.gpu import tooling
from suites import opdb

pytestmark = pytest.mark.host_only


def test_a_section_records_its_result_and_its_own_seconds(tmp_path, monkeypatch):
  """A section's result and duration (seconds it ran, not a clock reading) go into
  tooling.json; an error is recorded and the script goes on."""
  monkeypatch.setattr(tooling, "RESULTS", {"sections": {}, "errors": []})
  tooling.section("ok", str(tmp_path))(lambda x: {"x": x})(3)
  tooling.section("bad", str(tmp_path))(lambda: 1 / 0)()
  saved = json.loads((tmp_path / "tooling.json").read_text())
  assert saved["sections"] == {"ok": {"x": 3}}
  assert [e["section"] for e in saved["errors"]] == ["bad"]
  assert "ZeroDivisionError" in saved["errors"][0]["error"]
  assert set(saved["section_seconds"]) == {"ok", "bad"}
  assert all(0 <= s < 60 for s in saved["section_seconds"].values())


def _functions(dry):
  return {name: (f, args) for name, f, args in tooling.benchmark_functions(dry)}


@pytest.mark.parametrize("dry", [False, True])
def test_the_benchmark_functions_trace_at_their_shapes(dry):
  """Each benchmark function (forward and forward+backward) traces at its shapes: its
  arrays agree with each other (a scale as wide as the normalized rows, the contraction
  dims equal, group sizes summing to the rows)."""
  functions = _functions(dry)
  assert len(functions) == 16
  for name, (f, args) in functions.items():
    out = jax.eval_shape(f, *args)
    assert out is not None, name


def test_the_dry_run_takes_smaller_shapes():
  """`--dry` runs the same functions on a CPU at small shapes: every array of the dry run is
  at most 1/16 the size of the full run's, in the same layout."""
  full, dry = _functions(False), _functions(True)
  assert list(full) == list(dry)
  for name in full:
    for a, b in zip(full[name][1], dry[name][1], strict=True):
      assert len(a.shape) == len(b.shape) and a.dtype == b.dtype, name
      assert all(y <= x for x, y in zip(a.shape, b.shape, strict=True)), name
      assert 16 * math.prod(b.shape) <= math.prod(a.shape), name


def test_the_full_benchmark_shapes_are_the_op_database_benchmarks():
  """The default cache is tuned at the shapes the benchmarks run (docs/perf.md's cases):
  the layer_norm functions at the op database's GPU benchmark rows and widths."""
  calls = {(c.shape["rows"], c.shape["d"]) for c in opdb.get("layer_norm").bench[opdb.H100]}
  full = _functions(False)
  for name in ("layer_norm_fwd", "layer_norm_wide_fwd", "rms_norm_wide_fwd"):
    x, d = full[name][1]
    assert (x.shape[:1], x.shape[1]) in calls and d.shape == (x.shape[1],), name


def test_the_dry_timers_time_both_kernels_on_a_cpu(monkeypatch):
  """`--dry`'s timers section runs on a CPU: both kernels compile at their small shapes and
  get a wallclock time from `benchmark` and from the harness, each round."""
  monkeypatch.setattr(tooling, "RESULTS", {"sections": {}, "errors": []})
  result = tooling.timers(True)
  rows = {row["kernel"]: row for row in result["rows"]}
  assert set(rows) == {"attention_fwd_B4_T4096_N32_H128", "ragged_dot_M16384_K4096_N2048_G8"}
  for name, row in rows.items():
    assert row["benchmark_method"] == "wallclock" and len(row["rounds"]) == 3, name
    assert all(r["benchmark_ms"] > 0 and r["harness_ms"] > 0 for r in row["rounds"]), name


def test_main_runs_the_sections_not_skipped(tmp_path, monkeypatch):
  """`--skip` leaves out the sections it names and runs the others, in their order; an
  existing `--out` folder is reused."""
  monkeypatch.setattr(tooling, "RESULTS", {"sections": {}, "errors": []})
  ran = []
  for fn in ("timers", "autotune_step", "export_kernels", "default_cache"):
    monkeypatch.setattr(tooling, fn, lambda *a, fn=fn: ran.append(fn) or {"ran": fn})
  argv = ["tooling.py", "--out", str(tmp_path), "--dry", "--skip", "timers,export"]
  monkeypatch.setattr(sys, "argv", argv)
  tooling.main()
  assert ran == ["autotune_step", "default_cache"]
  saved = json.loads((tmp_path / "tooling.json").read_text())
  assert list(saved["sections"]) == ["autotune", "default_cache"] and saved["errors"] == []


def test_the_default_cache_tunes_with_the_time_left(tmp_path, monkeypatch):
  """Each function is tuned with the time left before the deadline less 25 s of margin; with
  under 30 s left, nothing more is tuned."""
  monkeypatch.setattr(tooling, "elapsed", lambda: 100.0)
  budgets = []

  def autotune(f, *args, time_budget_s, **kwargs):
    budgets.append(time_budget_s)
    return tokamax.AutotuningResult("cpu")

  monkeypatch.setattr(tokamax, "autotune", autotune)
  out = tooling.default_cache(str(tmp_path), True, 300.0, only={"swiglu_fwd"})
  assert budgets == [300.0 - 100.0 - 25.0]
  assert [d["function"] for d in out["done"]] == ["swiglu_fwd"]
  out = tooling.default_cache(str(tmp_path), True, 129.0, only={"swiglu"})
  assert budgets == [175.0] and out["done"] == []


def test_the_dry_export_round_trips_the_chunked_attention():
  """`--dry`'s export section on a CPU exports, serializes, restores and calls the chunked XLA
  attention's forward and gradient, bitwise equal to the jitted function; the kernels, which
  cannot run on a CPU, are skipped with a reason."""
  rows = tooling.export_kernels(True)["rows"]
  chunked = [r for r in rows if r["implementation"] == "xla_chunked"]
  assert [r["op"] for r in chunked] == ["dot_product_attention"]
  for what in ("forward", "gradient"):
    assert chunked[0].get(what, {}).get("bitwise_equal") is True, chunked[0]
  kernels = [r for r in rows if r["implementation"] != "xla_chunked"]
  assert kernels and all(r.get("skipped") for r in kernels), kernels
