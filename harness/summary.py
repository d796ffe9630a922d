"""The run's summary: tests per op and implementation, passed, failed, skipped with reasons.

Printed at the end of every pytest run that loads the harness, and written as
JSON or Markdown with `--summary-json` / `--summary-md`.
"""

import collections
import json
import os

from harness import hardware

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

  def as_dict(self) -> dict:
    rows = []
    for key in sorted(self.outcomes):
      counts = self.outcomes[key]
      rows.append(
        {
          "op": key[0],
          "implementation": key[1],
          "passed": counts["passed"],
          "failed": counts["failed"] + counts["error"],
          "skipped": counts["skipped"],
          "skip_reasons": dict(self.reasons[key].most_common()),
          "failures": self.failures[key],
        }
      )
    return {"hardware": hardware.detect().as_dict(), "rows": rows}

  def markdown(self) -> str:
    doc = self.as_dict()
    lines = [
      f"# Suite summary: {hardware.detect().describe()}",
      "",
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

  def pytest_terminal_summary(self, terminalreporter):
    if not self.outcomes or hasattr(self.config, "workerinput"):  # xdist: the controller writes.
      return
    terminalreporter.section("tokamax summary")
    doc = self.as_dict()
    width = max(len(f"{r['op']} [{r['implementation']}]") for r in doc["rows"])
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
