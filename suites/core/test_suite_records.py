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


@pytest.mark.parametrize(
  "device, folder", [("NVIDIA H200", "h200"), ("NVIDIA GeForce RTX 4090", "4090")]
)
def test_suite_record_writes_the_summary_under_the_device_and_commit(
  tmp_path, monkeypatch, capsys, device, folder
):
  """ci/gpu/suite_record.py writes the summary and the run's facts to
  suites/records/<last word of the device, lower case>/suite_<7-digit commit>.json."""
  from ci.gpu import suite_record

  summary = {
    "hardware": {"device_kind": device},
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
  want = tmp_path / "suites" / "records" / folder / "suite_0123456.json"
  assert capsys.readouterr().out.strip() == str(want)
  assert [str(p) for p in tmp_path.rglob("suite_*.json")] == [str(want)]
  record = json.loads(want.read_text())
  facts = {"commit": commit, "device": device, "wall_s": 12.5, "workers": 4}
  assert record == {**facts, "command": "bash ci/gpu_suite.sh", **summary}
  assert want.read_text().endswith("}\n")


@pytest.mark.parametrize("flag", ["--wall-s", "--workers", "--command"])
def test_suite_record_refuses_a_run_without_its_facts(tmp_path, monkeypatch, flag):
  """The run's wall time, workers and command are required: a record never lacks them."""
  from ci.gpu import suite_record

  src = tmp_path / "summary.json"
  src.write_text(json.dumps({"hardware": {"device_kind": "NVIDIA H200"}}))
  monkeypatch.setattr(suite_record, "ROOT", str(tmp_path))
  given = {"--commit": "0123456", "--wall-s": "1", "--workers": "1", "--command": "c"}
  argv = [str(src)] + [a for k, v in given.items() if k != flag for a in (k, v)]
  with pytest.raises(SystemExit):
    suite_record.main(argv)
  assert not list(tmp_path.rglob("suite_*.json"))
