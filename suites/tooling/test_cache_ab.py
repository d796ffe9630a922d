"""The shipped default cache against the heuristics (ci/gpu/cache_ab.py), in its --dry mode.

On a CPU the script's `--dry` mode compiles the chosen forward+backward benchmark functions
at small shapes with and without the default cache and times them in turn with wallclock.
The timer is replaced here by one that records which program it timed and answers known
times, so that the order, the rounds and the medians can be checked exactly.
"""

import sys

import jax
import numpy as np
import pytest

from bench import records
from ci.gpu import cache_ab, tooling
from tokamax._src import benchmarking

pytestmark = pytest.mark.host_only

_FUNCTIONS = ("swiglu", "layer_norm_wide")


def _run(tmp_path, monkeypatch, rounds, functions=_FUNCTIONS):
  """Runs the script's main on `functions` with `rounds` (None: the default); returns its
  records and the timer's calls."""
  labels = {}  # id(compiled program) -> "cached" or "heuristic"
  real_compiled = cache_ab._compiled

  def compiled(fn, arrays, use_default_cache):
    c = real_compiled(fn, arrays, use_default_cache)
    labels[id(c)] = "cached" if use_default_cache else "heuristic"
    return c

  calls = []  # (label, iterations, method), in order

  def time_compiled(fn, args, *, iterations, method=None):
    calls.append((labels[id(fn)], iterations, method))
    # Distinct times per call: call n's samples are n, n + 100 and n + 1000 (median n + 100).
    n = float(len(calls))
    return [n + 1000, n, n + 100]

  monkeypatch.setattr(cache_ab, "_compiled", compiled)
  monkeypatch.setattr(benchmarking, "time_compiled", time_compiled)
  out = tmp_path / "ab.json"
  argv = ["cache_ab.py", "--out", str(out), "--dry", "--functions", ",".join(functions)]
  argv += ["--iterations", "3"] + ([] if rounds is None else ["--rounds", str(rounds)])
  monkeypatch.setattr(sys, "argv", argv)
  cache_ab.main()
  return records.load(str(out)), calls


def test_the_dry_run_records_each_chosen_function_against_the_heuristics(tmp_path, monkeypatch):
  """One record per chosen function, in the schema, with its shapes; the cached and the
  heuristic programs timed in alternating order each round; medians of the rounds' medians."""
  rounds = 3
  recs, calls = _run(tmp_path, monkeypatch, rounds)
  assert [r.op for r in recs] == list(_FUNCTIONS)
  # Each round times both programs, the first of the round alternating.
  order = ["cached", "heuristic", "heuristic", "cached", "cached", "heuristic"]
  assert [c[0] for c in calls] == order * len(_FUNCTIONS)
  assert all(c[1:] == (3, "wallclock") for c in calls)
  shapes = {name: sds for name, _, sds in tooling.benchmark_functions(dry=True)}
  for k, r in enumerate(recs):
    base = _FUNCTIONS[k]
    assert r.case == base and r.mode == "fwd_bwd" and r.method == "wallclock"
    assert r.implementation == "None (shipped cache)" and r.anchor == "None (heuristics)"
    assert r.device == jax.devices()[0].device_kind
    sds = shapes[base + "_fwd_bwd"]
    assert r.shape == {
      f"arg{i}_dim{j}": d for i, s in enumerate(sds) for j, d in enumerate(s.shape)
    }
    # The timer's call n (1-based) has median n + 100.
    first = 2 * rounds * k
    medians = {"cached": [], "heuristic": []}
    for n, label in enumerate(order, start=first + 1):
      medians[label].append(n + 100.0)
    assert r.extra["rounds_ms"] == medians["cached"]
    assert r.extra["anchor_rounds_ms"] == medians["heuristic"]
    assert r.median_ms == pytest.approx(np.median(medians["cached"]))
    assert r.anchor_ms == pytest.approx(np.median(medians["heuristic"]))


def test_an_even_number_of_rounds_takes_the_median_between_two(tmp_path, monkeypatch):
  """With 2 rounds each program's median is the mean of its two rounds."""
  recs, calls = _run(tmp_path, monkeypatch, 2)
  assert len(calls) == 4 * len(_FUNCTIONS)
  r = recs[0]
  assert r.extra["rounds_ms"] == [101.0, 104.0]
  assert r.extra["anchor_rounds_ms"] == [102.0, 103.0]
  assert r.median_ms == pytest.approx(102.5) and r.anchor_ms == pytest.approx(102.5)


def test_the_rounds_default_to_five(tmp_path, monkeypatch):
  """Without --rounds each program is timed 5 times (the usage line's default)."""
  recs, calls = _run(tmp_path, monkeypatch, None, functions=("layer_norm_wide",))
  pair = ["cached", "heuristic"]
  assert [c[0] for c in calls] == (pair + pair[::-1]) * 2 + pair
  assert len(recs[0].extra["rounds_ms"]) == len(recs[0].extra["anchor_rounds_ms"]) == 5


def test_a_run_without_out_stops_before_compiling(monkeypatch, capsys):
  """--out is required: argparse's usage error comes before anything is compiled or timed."""
  compiled = []
  monkeypatch.setattr(cache_ab, "_compiled", lambda *a: compiled.append(a))
  monkeypatch.setattr(sys, "argv", ["cache_ab.py", "--dry", "--functions", "layer_norm_wide"])
  with pytest.raises(SystemExit) as exit_info:
    cache_ab.main()
  assert exit_info.value.code == 2 and not compiled
  assert "--out" in capsys.readouterr().err
