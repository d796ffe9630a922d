"""The one schema of benchmark records: every file under bench/results/ and `bench.run --out`.

A record file is a JSON object:

  {"schema": 1, "note": "<what the file shows>", "records": [<record>, ...]}

and each record is a `Record` (below) as a JSON object. Times are medians in
milliseconds; `anchor` names the implementation (or library) measured in the
same run for comparison (cuDNN for attention, XLA or `jax.lax.ragged_dot`
elsewhere) and `anchor_ms` is its time there, so that `ratio` compares like
with like. What a source measured beyond that (kernel breakdowns, rounds,
swept configs' neighbours) lives in `extra`.
"""

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

SCHEMA_VERSION = 1
MODES = ("fwd", "fwd_bwd")
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


@dataclasses.dataclass(frozen=True)
class Record:
  """One timed call: an implementation of an op on one case, and its anchor in the same run.

  Attributes:
    device: The device kind (`jax.Device.device_kind`, e.g. "NVIDIA H200", or "cpu").
    commit: The commit measured ("unknown" where the run could not tell).
    date: ISO 8601 date of the run, or None where the source did not keep it.
    op: The op's name (`SPEC.name`, e.g. "dot_product_attention").
    implementation: The implementation timed (a `SPEC.implementations` name, or a variant of one).
    case: The case's name (shape and feature in words, e.g. "B4 T4096 N32 H128 causal").
    shape: The case's dimensions by name.
    dtype: The inputs' dtype.
    mode: "fwd" or "fwd_bwd" (a training step: forward and VJP).
    median_ms: Median device time.
    anchor: The implementation measured beside it in the same run, or None.
    anchor_ms: The anchor's median device time in that run, or None.
    method: How time was measured ("cupti", "wallclock", ...), or None if unknown.
    config: The kernel config timed, or None for the implementation's own choice.
    extra: Anything else the source measured.
    schema: The schema version.
  """

  device: str
  commit: str
  date: str | None
  op: str
  implementation: str
  case: str
  shape: dict[str, int]
  dtype: str
  mode: str
  median_ms: float
  anchor: str | None = None
  anchor_ms: float | None = None
  method: str | None = None
  config: dict[str, Any] | None = None
  extra: dict[str, Any] = dataclasses.field(default_factory=dict)
  schema: int = SCHEMA_VERSION

  @property
  def ratio(self) -> float | None:
    """Our time over the anchor's (below 1: faster than the anchor)."""
    if self.anchor_ms is None:
      return None
    return self.median_ms / self.anchor_ms

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


_FIELDS = {f.name: f for f in dataclasses.fields(Record)}
_REQUIRED = [
  f.name
  for f in dataclasses.fields(Record)
  if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
]
_TYPES = {
  "device": str,
  "commit": str,
  "date": (str, type(None)),
  "op": str,
  "implementation": str,
  "case": str,
  "shape": dict,
  "dtype": str,
  "mode": str,
  "median_ms": (int, float),
  "anchor": (str, type(None)),
  "anchor_ms": (int, float, type(None)),
  "method": (str, type(None)),
  "config": (dict, type(None)),
  "extra": dict,
  "schema": int,
}


def _positive(x) -> bool:
  return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def validate_record(r: Any) -> list[str]:
  """What is wrong with one record (a JSON object); empty if nothing."""
  if not isinstance(r, dict):
    return [f"a record must be an object, not {type(r).__name__}"]
  errors = [f"missing field {name!r}" for name in _REQUIRED if name not in r]
  errors += [f"unknown field {name!r}" for name in r if name not in _FIELDS]
  for name, types in _TYPES.items():
    if name in r and not isinstance(r[name], types):
      errors.append(f"{name}: {type(r[name]).__name__} is not {types}")
  if errors:
    return errors
  if r.get("schema", SCHEMA_VERSION) != SCHEMA_VERSION:
    errors.append(f"schema {r['schema']} is not {SCHEMA_VERSION}")
  if r["mode"] not in MODES:
    errors.append(f"mode {r['mode']!r} is not one of {MODES}")
  if not _positive(r["median_ms"]):
    errors.append(f"median_ms {r['median_ms']!r} is not a positive number")
  if r.get("anchor_ms") is not None and not _positive(r["anchor_ms"]):
    errors.append(f"anchor_ms {r['anchor_ms']!r} is not a positive number")
  if (r.get("anchor") is None) != (r.get("anchor_ms") is None):
    errors.append("anchor and anchor_ms go together")
  if not all(
    isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
    for k, v in r["shape"].items()
  ):
    errors.append(f"shape {r['shape']!r} is not names to non-negative integers")
  return errors


def validate(obj: Any) -> list[str]:
  """What is wrong with a record file's content; empty if nothing."""
  if not isinstance(obj, dict) or not isinstance(obj.get("records"), list):
    return ['a record file is an object {"schema": 1, "records": [...]}']
  errors = []
  if obj.get("schema") != SCHEMA_VERSION:
    errors.append(f"file schema {obj.get('schema')!r} is not {SCHEMA_VERSION}")
  errors += [
    f"unknown top-level field {k!r}" for k in obj if k not in ("schema", "note", "records")
  ]
  for i, r in enumerate(obj["records"]):
    errors += [f"record {i}: {e}" for e in validate_record(r)]
  return errors


def from_dict(r: dict) -> Record:
  """A record from its JSON object (checked)."""
  errors = validate_record(r)
  if errors:
    raise ValueError("; ".join(errors))
  return Record(**r)


def load(path: str) -> list[Record]:
  """The records of a file; raises ValueError if it does not follow the schema."""
  with open(path) as f:
    obj = json.load(f)
  errors = validate(obj)
  if errors:
    raise ValueError(f"{path}: " + "; ".join(errors[:10]))
  return [Record(**r) for r in obj["records"]]


def note(path: str) -> str | None:
  """The file's note (what it shows)."""
  with open(path) as f:
    return json.load(f).get("note")


def write(path: str, records: Iterable[Record | dict], note: str | None = None) -> int:
  """Writes `records` (checked) to `path` in the schema; returns how many."""
  rows = [r.as_dict() if isinstance(r, Record) else from_dict(r).as_dict() for r in records]
  obj = {"schema": SCHEMA_VERSION, **({"note": note} if note else {}), "records": rows}
  errors = validate(obj)
  if errors:
    raise ValueError("; ".join(errors[:10]))
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(obj, f, indent=1)
    f.write("\n")
  return len(rows)


def files(root: str = RESULTS_DIR) -> Sequence[str]:
  """Every record file under `root` (bench/results/<device>/*.json), sorted."""
  out = []
  for dirpath, _, names in os.walk(root):
    out += [os.path.join(dirpath, n) for n in names if n.endswith(".json")]
  return sorted(out)
