"""The committed GPU suite records (suites/records/<device>/suite_<commit>.json) are whole runs."""

import glob
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FILES = sorted(glob.glob(os.path.join(ROOT, "suites", "records", "*", "suite_*.json")))
FIELDS = ("commit", "device", "wall_s", "workers", "command", "collected", "ran", "rows")


def test_the_latest_suite_record_is_cited_by_the_docs():
  if not FILES:
    pytest.skip("no GPU suite record committed yet (ci/gpu/suite_record.py makes one)")
  with open(os.path.join(ROOT, "docs", "perf.md")) as f:
    perf = f.read()
  assert any(os.path.relpath(p, ROOT) in perf for p in FILES), "docs/perf.md cites none"


@pytest.mark.parametrize("path", [os.path.relpath(p, ROOT) for p in FILES])
def test_suite_record_is_a_whole_green_run(path):
  with open(os.path.join(ROOT, path)) as f:
    record = json.load(f)
  missing = [k for k in FIELDS if k not in record]
  assert not missing, f"{path} lacks {missing}"
  assert os.path.basename(path) == f"suite_{record['commit'][:7]}.json"
  assert record["ran"] == record["collected"] > 0, "not every collected test ran"
  failed = {
    f"{r['op']} [{r['implementation']}]": r["failed"] for r in record["rows"] if r["failed"]
  }
  assert not failed, f"failures: {failed}"
  assert sum(r["passed"] for r in record["rows"]) > 0


def test_suite_record_writes_the_summary_under_the_device_and_commit(tmp_path, monkeypatch, capsys):
  """ci/gpu/suite_record.py writes the summary and the run's facts to
  suites/records/<last word of the device, lower case>/suite_<7-digit commit>.json."""
  from ci.gpu import suite_record

  summary = {
    "hardware": {"device_kind": "NVIDIA H200"},
    "collected": 3,
    "ran": 3,
    "rows": [{"op": "x", "implementation": "xla", "passed": 3, "failed": 0}],
  }
  src = tmp_path / "summary.json"
  src.write_text(json.dumps(summary))
  monkeypatch.setattr(suite_record, "ROOT", str(tmp_path))
  commit = "0123456789abcdef0123456789abcdef01234567"
  argv = [str(src), "--commit", commit, "--wall-s", "12.5", "--workers", "4"]
  assert suite_record.main([*argv, "--command", "bash ci/gpu_suite.sh"]) == 0
  want = tmp_path / "suites" / "records" / "h200" / "suite_0123456.json"
  assert capsys.readouterr().out.strip() == str(want)
  assert [str(p) for p in tmp_path.rglob("suite_*.json")] == [str(want)]
  record = json.loads(want.read_text())
  facts = {"commit": commit, "device": "NVIDIA H200", "wall_s": 12.5, "workers": 4}
  assert record == {**facts, "command": "bash ci/gpu_suite.sh", **summary}
  assert want.read_text().endswith("}\n")
