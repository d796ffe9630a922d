"""The summary's counting rules, in process (no pytest subprocess): fixture errors count as
failures, skip reasons lose pytest's "Skipped: " prefix, a JUnit error is not finished, and
a run cut short says how many tests it did not reach."""

import collections
import types

from tokamax_harness import summary

_OWNER = [(summary.OWNER_PROPERTY, ("layer_norm", "xla"))]


def _report(when, outcome, nodeid="t.py::test", longrepr=None):
  return types.SimpleNamespace(
    when=when,
    outcome=outcome,
    passed=outcome == "passed",
    failed=outcome == "failed",
    skipped=outcome == "skipped",
    user_properties=_OWNER,
    nodeid=nodeid,
    longrepr=longrepr,
  )


def test_live_counts():
  c = summary.Collector(config=None)
  c.pytest_runtest_logreport(_report("setup", "passed", "t.py::a"))
  c.pytest_runtest_logreport(_report("call", "passed", "t.py::a"))
  c.pytest_runtest_logreport(_report("teardown", "passed", "t.py::a"))
  c.pytest_runtest_logreport(_report("setup", "failed", "t.py::fixture_error"))  # An error.
  c.pytest_runtest_logreport(_report("call", "failed", "t.py::b"))
  skip = ("t.py", 3, "Skipped: needs a GPU")
  c.pytest_runtest_logreport(_report("setup", "skipped", "t.py::c", longrepr=skip))
  (row,) = c.as_dict()["rows"]
  assert (row["passed"], row["failed"], row["skipped"]) == (1, 2, 1)
  assert row["failures"] == ["t.py::fixture_error", "t.py::b"]
  assert row["skip_reasons"] == {"needs a GPU": 1}
  assert c.as_dict()["ran"] == 4


_JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
 <testcase classname="suites.t" name="test_pass">
  <properties><property name="tokamax_op" value="('layer_norm', 'xla')"/></properties>
 </testcase>
 <testcase classname="suites.t" name="test_fail">
  <properties><property name="tokamax_op" value="('layer_norm', 'xla')"/></properties>
  <failure message="assert 1 == 2">...</failure>
 </testcase>
 <testcase classname="suites.t" name="test_error">
  <properties><property name="tokamax_op" value="('layer_norm', 'xla')"/></properties>
  <error message="fixture failed">...</error>
 </testcase>
 <testcase classname="suites.t" name="test_skip">
  <skipped type="pytest.skip" message="Skipped: needs a GPU">...</skipped>
 </testcase>
</testsuite></testsuites>
"""


def test_junit_counts_and_finished_tests(tmp_path):
  path = tmp_path / "j.xml"
  path.write_text(_JUNIT)
  assert summary.junit_finished_ids(str(path)) == {
    ("suites.t", "test_pass"),
    ("suites.t", "test_skip"),
  }
  doc = summary.from_junit([str(path)], "host", collected=6)
  rows = {(r["op"], r["implementation"]): r for r in doc["rows"]}
  ln = rows[("layer_norm", "xla")]
  assert (ln["passed"], ln["failed"], ln["skipped"]) == (1, 2, 0)
  assert sorted(ln["failures"]) == ["suites.t::test_error", "suites.t::test_fail"]
  other = rows[summary.OTHER]
  assert (other["passed"], other["failed"], other["skipped"]) == (0, 0, 1)
  assert other["skip_reasons"] == {"needs a GPU": 1}
  assert (doc["collected"], doc["ran"]) == (6, 4)
  text = summary.markdown(doc)
  assert "4 of 6 collected tests ran; 2 not reached (time limit)." in text
  assert "- `suites.t::test_error`" in text


def test_markdown_of_a_complete_run_says_nothing_was_missed():
  doc = summary._document({}, {}, {}, 0, title="host")
  assert "0 of 0 collected tests ran." in summary.markdown(doc)


def test_junit_ids_of_items_name_their_class():
  """What --resume-from matches against JUnit: module path with dots, class, test name."""

  def item(nodeid):
    return types.SimpleNamespace(nodeid=nodeid)

  assert summary.item_junit_id(item("suites/core/test_x.py::test_y[a-b]")) == (
    "suites.core.test_x",
    "test_y[a-b]",
  )
  assert summary.item_junit_id(item("suites/core/test_x.py::TestZ::test_y")) == (
    "suites.core.test_x.TestZ",
    "test_y",
  )


def test_markdown_names_a_single_test_not_reached(tmp_path):
  path = tmp_path / "j.xml"
  path.write_text(_JUNIT)
  doc = summary.from_junit([str(path)], "host", collected=5)
  assert "4 of 5 collected tests ran; 1 not reached (time limit)." in summary.markdown(doc)


def test_a_later_run_overrides_an_earlier_outcome(tmp_path):
  """A resumed run reruns the first run's failures: its outcome is the one that counts."""
  first, second = tmp_path / "a.xml", tmp_path / "b.xml"
  case = '<testcase classname="suites.t" name="test_flaky"{}</testcase>'
  first.write_text(f"<testsuite>{case.format('><failure message="x"/>')}</testsuite>")
  second.write_text(f"<testsuite>{case.format('>')}</testsuite>")
  doc = summary.from_junit([str(first), str(second)], "host", collected=1)
  (row,) = doc["rows"]
  assert (row["passed"], row["failed"], doc["ran"], doc["runs"]) == (1, 0, 1, 2)
  doc = summary.from_junit([str(second), str(first)], "host", collected=1)
  assert (doc["rows"][0]["passed"], doc["rows"][0]["failed"]) == (0, 1)


def test_an_interrupted_runs_nameless_case_is_no_test(tmp_path):
  """pytest's JUnit file of a run stopped by its time limit ends with an empty <testcase/>:
  it is neither a passed test nor a finished one."""
  path = tmp_path / "j.xml"
  path.write_text(
    '<testsuite><testcase classname="suites.t" name="test_a"></testcase>'
    '<testcase time="0.000" /></testsuite>'
  )
  doc = summary.from_junit([str(path)], "host", collected=2)
  assert (doc["rows"][0]["passed"], doc["ran"]) == (1, 1)
  assert summary.junit_finished_ids(str(path)) == {("suites.t", "test_a")}


def test_markdown_row_lists_the_three_commonest_skip_reasons():
  """Four reasons seen 2, 4, 1 and 3 times: the row names the top three, commonest first, with
  a `|` in a reason turned into `/` so the table keeps its columns."""
  key = ("ragged_dot", "triton")
  outcomes = {key: collections.Counter(passed=1, skipped=10)}
  reasons = {
    key: collections.Counter({"no fp8": 2, "needs sm_90 | Hopper": 4, "tiny": 1, "big": 3})
  }
  doc = summary._document(outcomes, reasons, {key: []}, None, title="host")
  assert list(doc["rows"][0]["skip_reasons"]) == ["needs sm_90 | Hopper", "big", "no fp8", "tiny"]
  row = "| ragged_dot | triton | 1 | 0 | 10 | 4x needs sm_90 / Hopper; 3x big; 2x no fp8 |"
  assert row in summary.markdown(doc).splitlines()


def test_terminal_summary_lines():
  """The lines printed at the end of a run: ran of collected, then per op and implementation
  passed, failed (errors included), skipped and the commonest skip reason."""
  config = types.SimpleNamespace(getini=lambda name: "op summary", getoption=lambda name: None)
  c = summary.Collector(config)
  c.collected = 5
  c.pytest_runtest_logreport(_report("call", "passed", "t.py::a"))
  c.pytest_runtest_logreport(_report("setup", "failed", "t.py::fixture_error"))
  c.pytest_runtest_logreport(_report("call", "failed", "t.py::b"))
  skip = ("t.py", 3, "Skipped: needs a GPU")
  c.pytest_runtest_logreport(_report("setup", "skipped", "t.py::c", longrepr=skip))
  lines, sections = [], []
  reporter = types.SimpleNamespace(section=sections.append, write_line=lines.append)
  c.pytest_terminal_summary(reporter)
  assert sections == ["op summary"]
  assert lines == [
    "4 of 5 collected tests ran",
    "layer_norm [xla]  passed    1  failed   2  skipped    1  (needs a GPU)",
  ]


def test_xdist_controller_counts_the_collected_tests():
  """Under pytest-xdist the controller collects nothing; a worker's collection gives the count."""
  c = summary.Collector(config=None)
  c.pytest_xdist_node_collection_finished(node=None, ids=["t.py::a", "t.py::b", "t.py::c"])
  assert c.collected == 3


def test_a_failing_teardown_turns_a_pass_into_an_error():
  """pytest reports "1 passed, 1 error" and JUnit an <error>: the summary must not say passed."""
  c = summary.Collector(config=None)
  for nodeid, teardown in (("t.py::ok", "passed"), ("t.py::bad_teardown", "failed")):
    c.pytest_runtest_logreport(_report("setup", "passed", nodeid))
    c.pytest_runtest_logreport(_report("call", "passed", nodeid))
    c.pytest_runtest_logreport(_report("teardown", teardown, nodeid))
  # A test that failed already counts once, whatever its teardown does.
  c.pytest_runtest_logreport(_report("call", "failed", "t.py::both"))
  c.pytest_runtest_logreport(_report("teardown", "failed", "t.py::both"))
  (row,) = c.as_dict()["rows"]
  assert (row["passed"], row["failed"], row["skipped"]) == (1, 2, 0)
  assert row["failures"] == ["t.py::bad_teardown", "t.py::both"]
  assert c.as_dict()["ran"] == 3


def test_rows_are_sorted_by_op_and_implementation_not_by_arrival():
  """Under pytest-xdist reports arrive in any order; the summary's rows do not follow it."""
  c = summary.Collector(config=None)
  for op, impl in (("ragged_dot", "triton"), ("layer_norm", "xla"), ("layer_norm", "triton")):
    report = _report("call", "passed", f"t.py::{op}_{impl}")
    report.user_properties = [(summary.OWNER_PROPERTY, (op, impl))]
    c.pytest_runtest_logreport(report)
  rows = [(r["op"], r["implementation"]) for r in c.as_dict()["rows"]]
  assert rows == [("layer_norm", "triton"), ("layer_norm", "xla"), ("ragged_dot", "triton")]
