"""The suite summary: live counts, counts rebuilt from JUnit XML, and resuming a cut run."""

import json

from tokamax_harness import summary

pytest_plugins = ["pytester"]

_TESTS = """
import pytest

@pytest.mark.op("layer_norm", "xla")
def test_passes():
  assert 1 + 1 == 2

@pytest.mark.op("layer_norm", "xla")
def test_skips():
  pytest.skip("needs a GPU")

@pytest.mark.op("ragged_dot", "triton")
def test_fails():
  assert 1 + 1 == 3

def test_other():
  pass
"""


def _rows(doc: dict) -> dict:
  return {
    (r["op"], r["implementation"]): (r["passed"], r["failed"], r["skipped"]) for r in doc["rows"]
  }


def _run(pytester, *args):
  return pytester.runpytest_subprocess("-p", "tokamax_harness", "-p", "no:cacheprovider", *args)


def test_junit_summary_matches_the_live_one(pytester):
  pytester.makepyfile(test_inner=_TESTS)
  _run(pytester, "--junitxml=j.xml", "--summary-json=s.json", "-o", "junit_family=xunit2")
  live = json.loads((pytester.path / "s.json").read_text())
  rebuilt = summary.from_junit([str(pytester.path / "j.xml")], "test host", collected=4)
  expected = {
    ("layer_norm", "xla"): (1, 0, 1),
    ("ragged_dot", "triton"): (0, 1, 0),
    summary.OTHER: (1, 0, 0),
  }
  assert _rows(live) == expected
  assert _rows(rebuilt) == expected
  assert (live["collected"], live["ran"]) == (4, 4)
  reasons = {r["op"]: r["skip_reasons"] for r in rebuilt["rows"]}
  assert reasons["layer_norm"] == {"needs a GPU": 1}


def test_resume_runs_only_what_the_cut_run_missed(pytester):
  pytester.makepyfile(test_inner=_TESTS)
  _run(pytester, "-k", "not other", "--junitxml=first.xml", "-o", "junit_family=xunit2")
  second = _run(
    pytester, "--resume-from=first.xml", "--junitxml=second.xml", "-o", "junit_family=xunit2"
  )
  # The failure runs again; what passed or skipped does not.
  second.assert_outcomes(passed=1, failed=1, deselected=2)
  junits = [str(pytester.path / f) for f in ("first.xml", "second.xml")]
  merged = summary.from_junit(junits, "test host", collected=4)
  assert merged["ran"] == 4 and merged["runs"] == 2
  text = summary.markdown(merged)
  assert "# Suite summary: test host" in text and "4 of 4 collected tests ran over 2 runs." in text


def _junit_of(name: str, inner: str = "") -> str:
  return (
    '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">'
    f'<testcase classname="test_inner" name="{name}">{inner}</testcase></testsuite></testsuites>'
  )


def test_resume_from_several_runs_skips_what_any_of_them_finished(pytester):
  """`--resume-from` repeats: a test that passed in the first cut run and one that skipped in the
  second are both deselected, not only the last file's."""
  pytester.makepyfile(test_inner=_TESTS)
  (pytester.path / "first.xml").write_text(_junit_of("test_passes"))
  (pytester.path / "second.xml").write_text(_junit_of("test_skips", '<skipped message="x"/>'))
  third = _run(pytester, "--resume-from=first.xml", "--resume-from=second.xml")
  third.assert_outcomes(passed=1, failed=1, deselected=2)
