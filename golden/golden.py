"""Golden outputs: each implementation's result on small fixed-seed inputs, per hardware family.

A family's goldens live in `golden/data/<family>/`: `goldens.npz` (every
output's raw bits, compressed) and `manifest.json` (jax version, device kind,
commit, and per entry the case, the dtype and the harness tolerance it is
checked with). `check` recomputes every (case, implementation) that runs here
and compares it with its golden under the harness policy
(`tokamax_harness.tolerance`, `tokamax_harness.compare`); `regenerate` writes new goldens and
says what changed. An implementation that can run here but has no golden is
MISSING (a failure), never a silent pass; a family with no goldens at all is
reported as such.

The inputs come from the op database (`suites.opdb`): the same builders and
per-case seeds as the matrix tests, at each op's small golden shape.
"""

import dataclasses
import hashlib
import io
import json
import os
import zipfile
from collections.abc import Callable, Iterable

import jax
import numpy as np

from suites import matrices, opdb
from suites.matrices import cases as cases_lib
from suites.matrices import checks
from tokamax_harness import bench, compare, hardware, tolerance

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
NPZ = "goldens.npz"
MANIFEST = "manifest.json"

PASS = "PASS"
CHANGED = "CHANGED"  # Within tolerance of the golden, not bitwise equal.
FAIL = "FAIL"
MISSING = "MISSING"
SKIP = "SKIP"
ERROR = "ERROR"
NEW = "NEW"
REMOVED = "REMOVED"
FAILING = (FAIL, MISSING, ERROR)


def cases(family: str, ops: Iterable[str] | None = None) -> list[cases_lib.Case]:
  """The golden cases of `family`: golden shapes x the family matrix's dtypes x every feature."""
  out = []
  for op in ops or opdb.OPS:
    info = opdb.get(op)
    if family not in info.matrices:
      continue
    features = list(info.features)
    shape = cases_lib.shape_key(info.golden_shape)
    for dtype in info.matrices[family].dtypes:
      out += [cases_lib.Case(op, shape, dtype, f, family, "golden") for f in features]
  return out


def implementations(op: str, profile: hardware.Profile) -> list[matrices.Implementation]:
  """The op's native implementations here (interpret-mode kernels have no goldens)."""
  spec = opdb.get(op).spec
  out = []
  for name in spec.implementations:
    try:
      impl = matrices.resolve(spec, name, profile)
    except Exception as e:  # A module that fails to load is reported, not fatal.
      impl = matrices.Implementation(op, name, "?", None, f"failed to load: {e!r}")
    if not impl.interpret:
      out.append(impl)
  return out


def entry_key(case: cases_lib.Case, impl_name: str) -> str:
  return f"{case.op}.{impl_name}.{case.id}"


@dataclasses.dataclass
class Result:
  """One (case, implementation) outcome."""

  key: str
  status: str
  detail: str = ""
  output: np.ndarray | None = None
  entry: dict | None = None


def _tolerance(case: cases_lib.Case, platform: str) -> tolerance.Tolerance:
  return tolerance.for_dtype(case.dtype, platform=platform, has_matmul=case.has_matmul)


def _single(out) -> np.ndarray:
  leaves = jax.tree.leaves(out)
  if len(leaves) != 1:
    raise ValueError(f"expected one output array, got {len(leaves)}")
  return np.asarray(leaves[0])


def _to_bits(x: np.ndarray) -> np.ndarray:
  # bfloat16 is numpy kind "V", not "f": ask JAX which dtypes are floating.
  floating = jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
  return x.view(np.dtype(f"uint{8 * x.dtype.itemsize}")) if floating else x


def _from_bits(bits: np.ndarray, dtype: str) -> np.ndarray:
  return bits.view(jax.numpy.dtype(dtype))


def _digest(x: np.ndarray) -> str:
  return hashlib.sha256(np.require(x, requirements="C").tobytes()).hexdigest()[:16]


def compute(
  family: str,
  *,
  ops: Iterable[str] | None = None,
  keys: Iterable[str] | None = None,
  override: Callable[[cases_lib.Case, matrices.Implementation], Callable] | None = None,
) -> list[Result]:
  """Runs every golden case through every native implementation here.

  Args:
    family: The hardware family whose cases to run.
    ops: Restrict to these ops.
    keys: Restrict to these entries (`entry_key`).
    override: (case, impl) -> the callable to run instead of `impl` (tests use
      it to plant numerics changes).

  Returns:
    One result per (case, implementation): status "" with `output` and
    `entry` set, or SKIP/ERROR with the reason.
  """
  profile = hardware.detect()
  keys = None if keys is None else set(keys)
  results = []
  impls_of = {}
  for case in cases(family, ops):
    if case.op not in impls_of:
      impls_of[case.op] = implementations(case.op, profile)
    impls = [i for i in impls_of[case.op] if keys is None or entry_key(case, i.name) in keys]
    if not impls:
      continue
    args, kwargs = case.make_args(checks.case_key(case))
    reference = None
    for impl in impls:
      key = entry_key(case, impl.name)
      reason = impl.reason
      if reason is None:
        try:
          reason = impl.unsupported_reason(args, kwargs)
        except Exception as e:  # A broken implementation (e.g. its module): an error, not a skip.
          results.append(Result(key, ERROR, f"unsupported_reason raised {e!r}"[:500]))
          continue
      if reason is not None:
        results.append(Result(key, SKIP, f"{impl.name}: {reason}"))
        continue
      fn = override(case, impl) if override else impl
      try:
        out = _single(case.call(fn, args, kwargs, jit=not impl.eager))
        if reference is None:
          reference = _single(case.reference(args, kwargs))
      except Exception as e:
        results.append(Result(key, ERROR, f"{type(e).__name__}: {e}"[:500]))
        continue
      tol = _tolerance(case, profile.platform)
      ref_report = compare.compare(
        out, reference, tol=tol, reduction_length=case.reduction_length, name=key
      )
      entry = {
        "op": case.op,
        "implementation": impl.name,
        "case": case.id,
        "feature": case.feature,
        "shape": dict(case.shape),
        "dtype": case.dtype,
        "out_shape": list(out.shape),
        "out_dtype": str(out.dtype),
        "sha256": _digest(out),
        "reduction_length": case.reduction_length,
        "tolerance": dataclasses.asdict(tol),
        "reference_max_error": ref_report.max_error,
        "reference_ok": ref_report.ok,
      }
      results.append(Result(key, "", output=out, entry=entry))
  return results


def family_dir(family: str, data_dir: str = DATA_DIR) -> str:
  return os.path.join(data_dir, family)


def load(family: str, data_dir: str = DATA_DIR) -> tuple[dict, dict[str, np.ndarray]] | None:
  """(manifest, arrays) of a family's goldens, or None if there are none."""
  d = family_dir(family, data_dir)
  if not os.path.exists(os.path.join(d, MANIFEST)):
    return None
  with open(os.path.join(d, MANIFEST)) as f:
    manifest = json.load(f)
  with np.load(os.path.join(d, NPZ)) as z:
    arrays = {
      k: _from_bits(z[k], manifest["entries"][k]["out_dtype"])
      for k in z.files
      if k in manifest["entries"]
    }
  return manifest, arrays


def _compare_to_golden(result: Result, golden: np.ndarray) -> Result:
  entry = result.entry
  out = result.output
  if list(golden.shape) != list(out.shape) or str(golden.dtype) != str(out.dtype):
    return dataclasses.replace(
      result,
      status=FAIL,
      detail=f"golden is {golden.dtype}{list(golden.shape)}, output {out.dtype}{list(out.shape)}",
    )
  if np.array_equal(_to_bits(golden), _to_bits(out)):
    return dataclasses.replace(result, status=PASS, detail="bitwise equal")
  tol = tolerance.Tolerance(**entry["tolerance"])
  report = compare.compare(
    out, golden, tol=tol, reduction_length=entry["reduction_length"], name=result.key
  )
  if report.ok:
    return dataclasses.replace(
      result,
      status=CHANGED,
      detail=f"within tolerance: max abs diff {report.max_error:.3g}, "
      f"{report.num_off} of {report.size} past the bound",
    )
  return dataclasses.replace(result, status=FAIL, detail=report.message)


def check(
  family: str | None = None, *, data_dir: str = DATA_DIR, ops=None, keys=None, override=None
) -> tuple[list[Result], dict | None]:
  """Compares every (case, implementation) that runs here with its golden.

  Returns:
    (results, manifest): results carry PASS, CHANGED (within tolerance), FAIL,
    MISSING (runs here, no golden), SKIP (cannot run here: the reason) or
    ERROR; manifest is None where the family has no goldens at all.
  """
  profile = hardware.detect()
  family = family or profile.family
  stored = load(family, data_dir)
  manifest, arrays = stored if stored else (None, {})
  out = []
  for r in compute(family, ops=ops, keys=keys, override=override):
    if r.status:
      out.append(r)
    elif r.key not in arrays:
      where = family_dir(family, data_dir)
      out.append(
        dataclasses.replace(
          r, status=MISSING, detail=f"no golden for this implementation in {where}"
        )
      )
    else:
      r.entry["tolerance"] = manifest["entries"][r.key]["tolerance"]
      out.append(_compare_to_golden(r, arrays[r.key]))
  return out, manifest


def regenerate(
  family: str | None = None,
  *,
  data_dir: str = DATA_DIR,
  out_dir: str | None = None,
  ops=None,
) -> list[Result]:
  """Recomputes the goldens and writes them to `out_dir` (default: the data dir).

  Returns:
    What changed against the stored goldens in `data_dir`: NEW, CHANGED (with
    the max difference), FAIL (changed past tolerance), PASS (bitwise equal),
    REMOVED, SKIP and ERROR results (an ERROR case keeps its stored golden).
  """
  profile = hardware.detect()
  family = family or profile.family
  if family != profile.family:
    raise ValueError(f"goldens of {family} cannot be made on {profile.describe()}")
  stored = load(family, data_dir)
  old_manifest, old_arrays = stored if stored else ({"entries": {}}, {})
  computed = compute(family, ops=ops)
  fresh = {r.key: r for r in computed if not r.status}
  changes = []
  for r in computed:
    if r.status:
      changes.append(r)
    elif r.key not in old_arrays:
      changes.append(dataclasses.replace(r, status=NEW, detail="new golden"))
    else:
      changes.append(_compare_to_golden(r, old_arrays[r.key]))
  kept = {}
  if ops is not None:  # Regenerating some ops keeps the others' goldens.
    kept = {k: v for k, v in old_arrays.items() if old_manifest["entries"][k]["op"] not in ops}
  # A case that errored keeps its stored golden: the ERROR fails the run, and a passing
  # failure (an import, a driver) must not delete the value that a later run checks.
  errored = {r.key for r in computed if r.status == ERROR}
  kept.update({k: v for k, v in old_arrays.items() if k in errored})
  for key in sorted(set(old_arrays) - set(fresh) - set(kept)):
    changes.append(Result(key, REMOVED, "no longer produced here"))
  entries = {k: old_manifest["entries"][k] for k in kept}
  entries.update({k: r.entry for k, r in fresh.items()})
  arrays = dict(kept)
  arrays.update({k: r.output for k, r in fresh.items()})
  env = bench.environment()
  manifest = {
    "family": family,
    "device_kind": profile.device_kind,
    "platform": profile.platform,
    "jax_version": env["jax_version"],
    "commit": env["commit"],
    "date": env["date"],
    "shapes": {op: info.golden_shape for op, info in opdb.ALL.items()},
    "entries": dict(sorted(entries.items())),
  }
  write(family, manifest, arrays, out_dir or data_dir)
  return changes


def merge(
  family: str, parts: dict[str, str], *, data_dir: str = DATA_DIR, out_dir: str | None = None
):
  """Writes the goldens of `data_dir` with each op's entries taken from `parts[op]`.

  Args:
    family: The hardware family.
    parts: op -> a data dir whose goldens for that op were regenerated (e.g. by
      one `regenerate(ops=[op])` process each, run side by side).
    data_dir: The goldens that the other ops keep.
    out_dir: Where to write (default: `data_dir`).
  """
  stored = load(family, data_dir)
  manifest, arrays = stored if stored else ({"entries": {}}, {})
  entries = {k: e for k, e in manifest["entries"].items() if e["op"] not in parts}
  arrays = {k: v for k, v in arrays.items() if k in entries}
  for op, part_dir in parts.items():
    part = load(family, part_dir)
    if part is None:
      raise ValueError(f"no {family} goldens in {part_dir} (for {op})")
    part_manifest, part_arrays = part
    manifest = {k: v for k, v in part_manifest.items() if k != "entries"}
    for key, entry in part_manifest["entries"].items():
      if entry["op"] == op:
        entries[key], arrays[key] = entry, part_arrays[key]
  manifest["entries"] = dict(sorted(entries.items()))
  write(family, manifest, arrays, out_dir or data_dir)


def write(family: str, manifest: dict, arrays: dict[str, np.ndarray], data_dir: str) -> None:
  """Writes a family's goldens deterministically (fixed zip timestamps)."""
  d = family_dir(family, data_dir)
  os.makedirs(d, exist_ok=True)
  buf = io.BytesIO()
  with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
    for key in sorted(arrays):
      info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
      info.compress_type = zipfile.ZIP_DEFLATED
      member = io.BytesIO()
      np.lib.format.write_array(member, np.require(_to_bits(arrays[key]), requirements="C"))
      z.writestr(info, member.getvalue())
  with open(os.path.join(d, NPZ), "wb") as f:
    f.write(buf.getvalue())
  with open(os.path.join(d, MANIFEST), "w") as f:
    json.dump(manifest, f, indent=1, default=str)
    f.write("\n")


def table(results: list[Result], *, title: str) -> str:
  """A readable table of results, failures first."""
  order = {s: i for i, s in enumerate((FAIL, ERROR, MISSING, REMOVED, NEW, CHANGED, SKIP, PASS))}
  rows = sorted(results, key=lambda r: (order.get(r.status, 9), r.key))
  width = max([len(r.key) for r in rows] + [10])
  lines = [title, f"{'status':8} {'golden':{width}} detail", "-" * (width + 40)]
  for r in rows:
    detail = r.detail.splitlines() or [""]
    lines.append(f"{r.status:8} {r.key:{width}} {detail[0]}")
    lines += [f"{'':8} {'':{width}} {d}" for d in detail[1:]]
  counts = {}
  for r in results:
    counts[r.status] = counts.get(r.status, 0) + 1
  lines.append("totals: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
  return "\n".join(lines)
