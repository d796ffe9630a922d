"""The run's summary: tests per op and implementation, passed, failed, skipped with reasons.

Printed at the end of every pytest run that loads the harness, and written as
JSON or Markdown with `--summary-json` / `--summary-md`. Runs cut short by a time
limit go on with `--resume-from JUNIT` (tests that passed or skipped there are
deselected; failures run again), and
`python -m harness.summary JUNIT... --title HARDWARE --md M --json J` summarises them together.
"""

import argparse
import ast
import collections
import json
import os
import xml.etree.ElementTree as ET

import pytest

from . import hardware

OTHER = ("(harness and other tests)", "")
OWNER_PROPERTY = "tokamax_op"


def _skip_reason(report) -> str:
  longrepr = report.longrepr
  reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
  return reason.removeprefix("Skipped: ")


class Collector:
  """Counts outcomes by (op, implementation) from the `op` marker."""

  def __init__(self, config):
    self.config = config
    self.outcomes: dict[tuple[str, str], collections.Counter] = collections.defaultdict(
      collections.Counter
    )
    self.reasons: dict[tuple[str, str], collections.Counter] = collections.defaultdict(
      collections.Counter
    )
    self.failures: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    self.collected: int | None = None
    self._passed: dict[str, tuple[str, str]] = {}  # nodeid -> key, of tests counted passed.

  def pytest_collection_finish(self, session):
    self.collected = len(session.items)

  @pytest.hookimpl(optionalhook=True)
  def pytest_xdist_node_collection_finished(self, node, ids):
    self.collected = len(ids)

  def pytest_collection_modifyitems(self, items):
    for item in items:
      marker = item.get_closest_marker("op")
      if marker is not None:
        key = (str(marker.args[0]), str(marker.args[1]) if len(marker.args) > 1 else "")
        # Reports carry user_properties, also to the pytest-xdist controller (which collects nothing).
        item.user_properties.append((OWNER_PROPERTY, key))

  def pytest_runtest_logreport(self, report):
    key = tuple(dict(report.user_properties).get(OWNER_PROPERTY, OTHER))
    if report.when == "call" or (report.when == "setup" and not report.passed):
      outcome = "skipped" if report.skipped else report.outcome
      if report.when == "setup" and report.failed:
        outcome = "error"
      self.outcomes[key][outcome] += 1
      if report.skipped:
        self.reasons[key][_skip_reason(report)] += 1
      elif report.failed:
        self.failures[key].append(report.nodeid)
      else:
        self._passed[report.nodeid] = key
    elif report.when == "teardown":
      passed_key = self._passed.pop(report.nodeid, None)
      if passed_key is not None and report.failed:
        # A fixture whose teardown fails errors a test that passed (pytest: "1 passed, 1
        # error"; JUnit: an <error> in the test case), so it is no pass.
        self.outcomes[passed_key]["passed"] -= 1
        self.outcomes[passed_key]["error"] += 1
        self.failures[passed_key].append(report.nodeid)

  def as_dict(self) -> dict:
    profile = hardware.detect()
    return _document(
      self.outcomes,
      self.reasons,
      self.failures,
      self.collected,
      title=profile.describe(),
      hardware_info=profile.as_dict(),
    )

  def markdown(self) -> str:
    return markdown(self.as_dict())

  def pytest_terminal_summary(self, terminalreporter):
    if not self.outcomes or hasattr(self.config, "workerinput"):  # xdist: the controller writes.
      return
    terminalreporter.section(self.config.getini("harness_summary_title"))
    doc = self.as_dict()
    width = max(len(f"{r['op']} [{r['implementation']}]") for r in doc["rows"])
    if doc["collected"] is not None:
      terminalreporter.write_line(f"{doc['ran']} of {doc['collected']} collected tests ran")
    for r in doc["rows"]:
      name = f"{r['op']} [{r['implementation']}]" if r["implementation"] else r["op"]
      top = next(iter(r["skip_reasons"]), "")
      terminalreporter.write_line(
        f"{name:<{width}}  passed {r['passed']:4d}  failed {r['failed']:3d}  skipped {r['skipped']:4d}"
        + (f"  ({top[:90]})" if top else "")
      )
    for option, text in (
      ("--summary-json", lambda: json.dumps(doc, indent=1)),
      ("--summary-md", self.markdown),
    ):
      path = self.config.getoption(option)
      if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
          f.write(text())
        terminalreporter.write_line(f"summary written to {path}")


def _document(
  outcomes,
  reasons,
  failures,
  collected: int | None,
  *,
  title: str,
  hardware_info: dict | None = None,
  runs: int = 1,
) -> dict:
  rows = []
  for key in sorted(outcomes):
    counts = outcomes[key]
    rows.append(
      {
        "op": key[0],
        "implementation": key[1],
        "passed": counts["passed"],
        "failed": counts["failed"] + counts["error"],
        "skipped": counts["skipped"],
        "skip_reasons": dict(reasons[key].most_common()),
        "failures": failures[key],
      }
    )
  ran = sum(r["passed"] + r["failed"] + r["skipped"] for r in rows)
  return {
    "title": title,
    "hardware": hardware_info,
    "collected": collected,
    "ran": ran,
    "runs": runs,
    "rows": rows,
  }


def markdown(doc: dict) -> str:
  """The summary document as a Markdown table."""
  lines = [f"# Suite summary: {doc['title']}", ""]
  if doc.get("collected") is not None:
    missing = doc["collected"] - doc["ran"]
    lines += [
      f"{doc['ran']} of {doc['collected']} collected tests ran"
      + (f" over {doc['runs']} runs" if doc.get("runs", 1) > 1 else "")
      + (f"; {missing} not reached (time limit)." if missing > 0 else "."),
      "",
    ]
  lines += [
    "| op | implementation | passed | failed | skipped | skip reasons |",
    "| --- | --- | ---: | ---: | ---: | --- |",
  ]
  for r in doc["rows"]:
    reasons = "; ".join(f"{n}x {why}" for why, n in list(r["skip_reasons"].items())[:3])
    lines.append(
      f"| {r['op']} | {r['implementation']} | {r['passed']} | {r['failed']} | {r['skipped']} | "
      f"{reasons.replace('|', '/')} |"
    )
  failures = [f for r in doc["rows"] for f in r["failures"]]
  if failures:
    lines += ["", "Failures:", *(f"- `{f}`" for f in failures)]
  return "\n".join(lines) + "\n"


def junit_finished_ids(path: str) -> set[tuple[str, str]]:
  """(classname, name) of the test cases a JUnit XML file records as passed or skipped."""
  return {
    (case.get("classname", ""), case.get("name", ""))
    for case in _test_cases(path)
    if case.find("failure") is None and case.find("error") is None
  }


def _test_cases(path: str) -> list[ET.Element]:
  """The named test cases of a JUnit XML file (an interrupted run also writes a nameless one)."""
  return [case for case in ET.parse(path).getroot().iter("testcase") if case.get("name")]


def item_junit_id(item) -> tuple[str, str]:
  """The (classname, name) pytest's JUnit writer gives `item`."""
  parts = item.nodeid.split("::")
  module = parts[0].removesuffix(".py").replace("/", ".")
  return ".".join([module, *parts[1:-1]]), parts[-1]


def from_junit(paths: list[str], title: str, collected: int | None = None) -> dict:
  """The summary document of one or more JUnit XML files (later files win per test).

  Args:
    paths: The JUnit XML files, earliest run first.
    title: The hardware they ran on, in words (JUnit does not record it).
    collected: How many tests the full suite collects, if known.
  """
  cases = {}
  for path in paths:
    for case in _test_cases(path):
      cases[case.get("classname", ""), case.get("name", "")] = case
  outcomes = collections.defaultdict(collections.Counter)
  reasons = collections.defaultdict(collections.Counter)
  failures = collections.defaultdict(list)
  for (classname, name), case in cases.items():
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    key = tuple(ast.literal_eval(props[OWNER_PROPERTY])) if OWNER_PROPERTY in props else OTHER
    skipped = case.find("skipped")
    if skipped is not None:
      outcomes[key]["skipped"] += 1
      reasons[key][(skipped.get("message") or "").removeprefix("Skipped: ")] += 1
    elif case.find("failure") is not None or case.find("error") is not None:
      outcomes[key]["failed"] += 1
      failures[key].append(f"{classname}::{name}")
    else:
      outcomes[key]["passed"] += 1
  return _document(outcomes, reasons, failures, collected, title=title, runs=len(paths))


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description="Summarise JUnit XML files of suite runs.")
  parser.add_argument("junit", nargs="+")
  parser.add_argument("--collected", type=int, default=None, help="tests the full suite collects")
  parser.add_argument("--title", required=True, help="the hardware the runs ran on, in words")
  parser.add_argument("--json", default=None)
  parser.add_argument("--md", default=None)
  opts = parser.parse_args(argv)
  doc = from_junit(opts.junit, opts.title, opts.collected)
  text = markdown(doc)
  if opts.json:
    with open(opts.json, "w") as f:
      json.dump(doc, f, indent=1)
  if opts.md:
    with open(opts.md, "w") as f:
      f.write(text)
  print(text)


if __name__ == "__main__":
  main()
