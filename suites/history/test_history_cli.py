"""Where `python -m bench.history run` appends: a local run leaves the tracked history alone."""

import os

import pytest

from bench import history
from suites.history import rows

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _record(ms=1.0, run_id="now@2026"):
  return rows.history_row(ms, run_id, device_time_min_ms=ms * 0.99)


@pytest.fixture
def files(tmp_path, monkeypatch):
  """The tracked and local history files moved to tmp_path; `run` measures nothing."""
  tracked, local = tmp_path / "tracked.jsonl", tmp_path / "out" / "history.jsonl"
  monkeypatch.setattr(history, "HISTORY", str(tracked))
  monkeypatch.setattr(history, "LOCAL_HISTORY", str(local))
  monkeypatch.setattr(history, "run", lambda *a, **k: [_record()])
  return tracked, local


def _count(path) -> int:
  return len(history.load(str(path)))


def test_local_run_appends_to_the_ignored_file(files):
  tracked, local = files
  assert history.main(["run"]) == 0
  assert _count(tracked) == 0 and _count(local) == 1


def test_append_tracked_appends_to_the_tracked_file(files):
  tracked, local = files
  assert history.main(["run", "--append-tracked"]) == 0
  assert _count(tracked) == 1 and _count(local) == 0


def test_explicit_history_and_no_append(files, tmp_path):
  tracked, local = files
  other = tmp_path / "other.jsonl"
  assert history.main(["run", "--history", str(other)]) == 0
  assert _count(other) == 1 and _count(tracked) == 0 and _count(local) == 0
  assert history.main(["run", "--no-append"]) == 0
  assert history.main(["run", "--no-append", "--append-tracked"]) == 0
  assert _count(tracked) == 0 and _count(local) == 0
  with pytest.raises(SystemExit):
    history.main(["run", "--append-tracked", "--history", str(other)])


def test_local_run_is_checked_against_the_tracked_history(files, capsys):
  """The baseline of a local run: the tracked runs and the local ones."""
  tracked, _ = files
  history.append([_record(0.5, f"old{i}@2026") for i in range(3)], str(tracked))
  assert history.main(["run", "--check"]) == 1
  assert "SLOWER" in capsys.readouterr().out
  assert _count(tracked) == 3


def test_the_nightly_appends_to_the_tracked_history():
  with open(os.path.join(ROOT, "ci", "nightly.sh")) as f:
    lines = [ln for ln in f if "-m bench.history run" in ln]
  assert lines and all("--append-tracked" in ln for ln in lines), lines
