"""Benchmark records: device time, FLOP/s and GB/s, and their JSON form.

`record` fills a pytest-benchmark fixture's `extra_info`, so that
`--benchmark-json` carries device times; `measurement` builds the same record
outside pytest, and `write_json` stores a list of them.
"""

import dataclasses
import datetime
import json
import os
import subprocess
from typing import Any

import jax

from . import hardware, timing


@dataclasses.dataclass(frozen=True)
class Measurement:
  """One benchmarked call."""

  op: str
  implementation: str
  case: str
  mode: str  # "fwd" or "fwd_bwd"
  shapes: dict[str, Any]
  dtype: str
  timing: timing.Timing
  flops: float | None
  bytes: float | None

  @property
  def tflops(self) -> float | None:
    return None if not self.flops else self.flops / self.timing.median_s * 1e-12

  @property
  def gbps(self) -> float | None:
    return None if not self.bytes else self.bytes / self.timing.median_s * 1e-9

  def as_dict(self) -> dict:
    profile = hardware.detect()
    return {
      "op": self.op,
      "implementation": self.implementation,
      "case": self.case,
      "mode": self.mode,
      "shapes": self.shapes,
      "dtype": self.dtype,
      **{f"device_time_{k}": v for k, v in self.timing.as_dict().items()},
      "flops": self.flops,
      "bytes": self.bytes,
      "tflops_per_s": self.tflops,
      "gb_per_s": self.gbps,
      "device_kind": profile.device_kind,
      "family": profile.family,
    }


def measurement(
  *,
  op: str,
  implementation: str,
  case: str,
  mode: str,
  shapes: dict,
  dtype: str,
  result: timing.Timing,
  cost: Any = None,
) -> Measurement:
  """A measurement; `cost` is the op's `SPEC.cost(args)` (forward work), if known.

  For mode "fwd_bwd" the FLOPs are counted as three times the forward's
  (the backward of a matmul-shaped op does twice the forward's work).
  """
  factor = 3.0 if mode == "fwd_bwd" else 1.0
  return Measurement(
    op=op,
    implementation=implementation,
    case=case,
    mode=mode,
    shapes=shapes,
    dtype=dtype,
    timing=result,
    flops=None if cost is None else factor * cost.flops,
    bytes=None if cost is None else factor * cost.bytes,
  )


def record(benchmark, m: Measurement) -> dict:
  """Puts `m` into a pytest-benchmark fixture's `extra_info`; returns the dict."""
  info = m.as_dict()
  if benchmark is not None:
    benchmark.extra_info.update(info)
  return info


def current_commit() -> str:
  """The commit under test: GITHUB_SHA where set (a device copy of the tree may carry a stale
  .git), else git's HEAD, else "unknown"."""
  if os.environ.get("GITHUB_SHA"):
    return os.environ["GITHUB_SHA"]
  try:
    return subprocess.run(
      ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
    ).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return "unknown"


def environment() -> dict:
  """Commit, date, jax version and device: the context of a set of records."""
  commit = current_commit()
  return {
    "commit": commit,
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "jax_version": jax.__version__,
    "hardware": hardware.detect().as_dict(),
  }


def write_json(path: str, records: list[dict | Measurement], **extra) -> dict:
  """Writes the records with their environment to `path`; returns the document."""
  doc = {
    **environment(),
    **extra,
    "records": [r.as_dict() if isinstance(r, Measurement) else r for r in records],
  }
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(doc, f, indent=1, default=str)
  return doc
