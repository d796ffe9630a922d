"""The cited benchmark records: every file under bench/results/ follows the one schema, and every
record path cited in src/, docs/, README.md, ci/ and bench/ exists."""

import dataclasses
import json
import os
import re

import pytest

from bench import records

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CITING = ("src", "docs", "bench", "ci", "README.md")
# A full path, or (in docs/*.md) one relative to bench/results/: "<device>/<file>.json".
FULL = re.compile(r"bench/results/[\w./-]+?\.json(?!\w)")
RELATIVE = re.compile(r"(?<![\w/.-])([a-z][a-z0-9]*/[\w.-]+?\.json)(?!\w)")


def _citing_files():
  for top in CITING:
    path = os.path.join(ROOT, top)
    if os.path.isfile(path):
      yield path
      continue
    for dirpath, dirnames, names in os.walk(path):
      dirnames[:] = [d for d in dirnames if d not in ("results", "out", "__pycache__")]
      for n in names:
        if n.endswith((".py", ".md", ".sh", ".toml", ".txt")):
          yield os.path.join(dirpath, n)


def _citations() -> list[tuple[str, str]]:
  out = []
  for path in _citing_files():
    with open(path, errors="replace") as f:
      text = f.read()
    rel = os.path.relpath(path, ROOT)
    out += [(rel, m) for m in FULL.findall(text)]
    if os.path.dirname(rel) == "docs" and rel.endswith(".md"):
      out += [(rel, "bench/results/" + m) for m in RELATIVE.findall(text)]
  return out


def test_there_are_records():
  assert records.files(), "bench/results/ holds no record files"


@pytest.mark.parametrize("path", [os.path.relpath(p, ROOT) for p in records.files()] or ["none"])
def test_record_file_follows_the_schema(path):
  full = os.path.join(ROOT, path)
  assert os.path.basename(os.path.dirname(full)) != "results", (
    "records live in bench/results/<device>/"
  )
  assert records.load(full), f"{path} holds no records"


def test_cited_records_exist():
  cited = _citations()
  assert any(src == os.path.join("docs", "perf.md") for src, _ in cited), (
    "docs/perf.md cites no records"
  )
  missing = sorted({(src, p) for src, p in cited if not os.path.exists(os.path.join(ROOT, p))})
  assert not missing, missing


def test_write_load_round_trip_and_validation(tmp_path):
  rec = records.from_dict(_good() | {"date": None, "mode": "fwd", "anchor": "xla"})
  path = tmp_path / "r.json"
  assert records.write(str(path), [rec], note="test") == 1
  assert records.load(str(path)) == [rec]
  assert rec.ratio == 2.0
  bad = rec.as_dict() | {"mode": "bwd", "median_ms": -1.0, "anchor": None}
  errors = records.validate({"schema": 1, "records": [bad]})
  assert any("mode" in e for e in errors)
  assert any("median_ms" in e for e in errors)
  assert any("anchor and anchor_ms" in e for e in errors)
  with pytest.raises(ValueError):
    records.write(str(path), [bad])


def _good() -> dict:
  return records.Record(
    device="cpu",
    commit="abc",
    date="2026-01-02",
    op="layer_norm",
    implementation="xla",
    case="plain",
    shape={"M": 8, "D": 64},
    dtype="float32",
    mode="fwd_bwd",
    median_ms=0.5,
    anchor="jnp",
    anchor_ms=0.25,
    method="cputime",
    config={"block": 8},
  ).as_dict()


def test_a_good_record_has_no_errors():
  assert records.validate_record(_good()) == []
  assert records.validate({"schema": 1, "note": "n", "records": [_good()]}) == []
  assert records.from_dict(_good()).ratio == 2.0
  # A dimension of 0 is non-negative (an empty case), and -1 is not (in the bad records below).
  assert records.validate_record(_good() | {"shape": {"M": 0, "D": 64}}) == []


@pytest.mark.parametrize(
  "change, expected",
  [
    ({"speed": 1.0}, "unknown field 'speed'"),
    ({"median_ms": True}, "median_ms True is not a positive number"),
    ({"median_ms": 0.0}, "median_ms 0.0 is not a positive number"),
    ({"median_ms": float("inf")}, "median_ms inf is not a positive number"),
    ({"median_ms": float("nan")}, "median_ms nan is not a positive number"),
    ({"anchor_ms": -0.25}, "anchor_ms -0.25 is not a positive number"),
    ({"anchor_ms": 0}, "anchor_ms 0 is not a positive number"),
    ({"anchor_ms": None}, "anchor and anchor_ms go together"),
    ({"schema": 2}, "schema 2 is not 1"),
    ({"mode": "bwd"}, "mode 'bwd' is not one of"),
    ({"shape": {"M": 8.0}}, "is not names to non-negative integers"),
    ({"shape": {0: 8}}, "is not names to non-negative integers"),
    ({"shape": {"M": True}}, "is not names to non-negative integers"),  # JSON true is no dimension.
    ({"shape": {"M": -8}}, "is not names to non-negative integers"),
    ({"median_ms": "0.5"}, "median_ms: str is not"),
    ({"date": 20260102}, "date: int is not"),
    ({"extra": None}, "extra: NoneType is not"),
  ],
)
def test_a_bad_record_is_named(change, expected):
  errors = records.validate_record(_good() | change)
  assert any(expected in e for e in errors), errors
  with pytest.raises(ValueError, match=re.escape(expected)):
    records.from_dict(_good() | change)


def test_a_missing_field_is_named():
  r = _good()
  del r["median_ms"]
  assert "missing field 'median_ms'" in records.validate_record(r)


def test_only_the_fields_without_defaults_are_required():
  minimal = {
    "device": "cpu",
    "commit": "abc",
    "date": None,
    "op": "layer_norm",
    "implementation": "xla",
    "case": "plain",
    "shape": {"M": 8},
    "dtype": "float32",
    "mode": "fwd",
    "median_ms": 0.5,
  }
  assert records.validate_record(minimal) == []
  assert records.from_dict(minimal).extra == {}
  for name in minimal:
    partial = {k: v for k, v in minimal.items() if k != name}
    assert f"missing field {name!r}" in records.validate_record(partial)


@pytest.mark.parametrize(
  "obj, expected",
  [
    ({"schema": 2, "records": []}, "file schema 2 is not 1"),
    ({"records": []}, "file schema None is not 1"),
    ({"schema": 1, "records": [], "notes": "x"}, "unknown top-level field 'notes'"),
    ({"schema": 1, "records": {}}, "a record file is an object"),
    ({"schema": 1, "records": [_good(), [1]]}, "record 1: a record must be an object"),
  ],
)
def test_a_bad_record_file_is_named(obj, expected):
  errors = records.validate(obj)
  assert any(expected in e for e in errors), errors


def test_load_refuses_a_file_off_the_schema_and_write_keeps_the_note(tmp_path):
  path = tmp_path / "r.json"
  path.write_text(json.dumps({"schema": 1, "records": [_good() | {"mode": "bwd"}]}))
  with pytest.raises(ValueError, match="mode 'bwd'"):
    records.load(str(path))
  assert records.write(str(path), [_good()], note="what it shows") == 1
  assert records.note(str(path)) == "what it shows"
  assert records.load(str(path)) == [records.from_dict(_good())]
  records.write(str(path), [_good()])
  assert records.note(str(path)) is None


def test_every_record_file_is_cited():
  """bench/results/ keeps only what a doc, a heuristic or the dashboard cites."""
  cited = {os.path.normpath(p) for _, p in _citations()}
  kept = {os.path.relpath(p, ROOT) for p in records.files()}
  uncited = sorted(kept - cited)
  assert not uncited, f"record files nobody cites (remove them or cite them): {uncited}"


def test_files_are_the_json_files_under_the_root_sorted(tmp_path):
  for name in ("h200/b.json", "cpu/z.json", "cpu/a.json", "cpu/notes.md", "h200/b.json.bak"):
    (tmp_path / name).parent.mkdir(exist_ok=True)
    (tmp_path / name).write_text("{}")
  expected = [str(tmp_path / n) for n in ("cpu/a.json", "cpu/z.json", "h200/b.json")]
  assert list(records.files(str(tmp_path))) == expected


def test_write_refuses_a_bad_record_object_and_writes_nothing(tmp_path):
  """A `Record` built directly skips `from_dict`'s check; `write` still validates the file."""
  bad = dataclasses.replace(records.from_dict(_good()), mode="bwd", median_ms=0.0)
  path = tmp_path / "r.json"
  with pytest.raises(ValueError, match="mode 'bwd'"):
    records.write(str(path), [bad])
  assert not path.exists()
