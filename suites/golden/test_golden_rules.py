"""The golden checker's verdicts on planted goldens: mismatched outputs, the stored
tolerance, and which goldens a partial regeneration or a merge keeps."""

import dataclasses
import os
import shutil
import time
import zipfile

import jax.numpy as jnp
import numpy as np
import pytest

from golden import golden
from tokamax_harness import hardware

FAMILY = hardware.detect().family
F32 = {"atol": 2e-6, "rtol": 1e-5}


def _result(out, tol=F32):
  entry = {"tolerance": dict(tol), "reduction_length": 1}
  return golden.Result("op.impl.case", "", output=out, entry=entry)


def _verdict(golden_value, out, tol=F32):
  return golden._compare_to_golden(_result(out, tol), golden_value)


def test_compare_to_golden_verdicts():
  out = np.linspace(0.5, 2.0, 64, dtype=np.float32).reshape(8, 8)
  assert _verdict(out.copy(), out).status == golden.PASS
  # A few ulps off everywhere: within the float32 tolerance, not bitwise.
  near = (out * np.float32(1 + 3e-7)).astype(np.float32)
  assert not np.array_equal(near, out)
  r = _verdict(near, out)
  assert r.status == golden.CHANGED and "within tolerance" in r.detail, r
  r = _verdict(out * np.float32(1.01), out)
  assert r.status == golden.FAIL, r
  # The stored tolerance decides: a tight one fails what the float32 one allows.
  r = _verdict(near, out, tol={"atol": 1e-12, "rtol": 1e-12})
  assert r.status == golden.FAIL, r


@pytest.mark.parametrize(
  "stored",
  [
    np.linspace(0.5, 2.0, 64, dtype=np.float32).reshape(8, 8).T.reshape(4, 16),
    np.linspace(0.5, 2.0, 64, dtype=np.float32)[:32].reshape(4, 8),
    np.linspace(0.5, 2.0, 64, dtype=np.float64).reshape(8, 8),
    np.linspace(0.5, 2.0, 64, dtype=np.float16).reshape(8, 8),
  ],
  ids=["reshaped", "fewer", "float64", "float16"],
)
def test_a_golden_of_another_shape_or_dtype_fails(stored):
  out = np.linspace(0.5, 2.0, 64, dtype=np.float32).reshape(8, 8)
  r = _verdict(stored, out)
  assert r.status == golden.FAIL and r.detail.startswith("golden is"), r


def _copy_goldens(tmp_path) -> str:
  data = str(tmp_path / "data")
  shutil.copytree(golden.family_dir(FAMILY), os.path.join(data, FAMILY))
  return data


def _float32_layer_norm_key(manifest) -> str:
  return next(
    k
    for k, e in sorted(manifest["entries"].items())
    if e["op"] == "layer_norm" and e["implementation"] == "xla" and e["dtype"] == "float32"
  )


def test_check_uses_the_tolerance_stored_with_the_golden(tmp_path):
  data = _copy_goldens(tmp_path)
  manifest, arrays = golden.load(FAMILY, data)
  key = _float32_layer_norm_key(manifest)
  arrays[key] = (arrays[key].astype(np.float64) * (1 + 1e-6)).astype(arrays[key].dtype)
  golden.write(FAMILY, manifest, arrays, data)
  (r,), _ = golden.check(FAMILY, data_dir=data, keys=[key])
  assert r.status == golden.CHANGED, r.detail  # Within the float32 tolerance.
  manifest["entries"][key]["tolerance"] = dataclasses.asdict(
    golden.tolerance.Tolerance(atol=1e-12, rtol=1e-12)
  )
  golden.write(FAMILY, manifest, arrays, data)
  (r,), _ = golden.check(FAMILY, data_dir=data, keys=[key])
  assert r.status == golden.FAIL, r.detail


def test_regenerating_some_ops_keeps_the_others_and_reports_removed_goldens(tmp_path):
  data = _copy_goldens(tmp_path)
  manifest, arrays = golden.load(FAMILY, data)
  others = {k: v for k, v in arrays.items() if not k.startswith("layer_norm.")}
  assert others
  gone = "layer_norm.no_such_impl.case"
  arrays[gone] = np.zeros((2,), np.float32)
  manifest["entries"][gone] = dict(manifest["entries"][_float32_layer_norm_key(manifest)])
  golden.write(FAMILY, manifest, arrays, data)
  changes = golden.regenerate(FAMILY, data_dir=data, ops=["layer_norm"])
  assert [r.key for r in changes if r.status == golden.REMOVED] == [gone]
  manifest, regenerated = golden.load(FAMILY, data)
  assert gone not in regenerated and gone not in manifest["entries"]
  assert set(regenerated) == set(arrays) - {gone}
  for key, value in others.items():
    np.testing.assert_array_equal(regenerated[key], value, err_msg=key)
    assert manifest["entries"][key]["op"] != "layer_norm"


def test_merge_takes_each_op_from_its_own_part(tmp_path):
  data = _copy_goldens(tmp_path)
  manifest, arrays = golden.load(FAMILY, data)
  # A part holds every op's goldens (a partial regeneration keeps the others): planted
  # values in both; only the op it was made for may come from it.
  part = str(tmp_path / "part")
  planted = {k: (v.astype(np.float32) * 3).astype(v.dtype) for k, v in arrays.items()}
  golden.write(FAMILY, manifest, planted, part)
  out = str(tmp_path / "out")
  golden.merge(FAMILY, {"layer_norm": part}, data_dir=data, out_dir=out)
  merged_manifest, merged = golden.load(FAMILY, out)
  assert set(merged) == set(arrays) == set(merged_manifest["entries"])
  for key, value in merged.items():
    expected = planted[key] if key.startswith("layer_norm.") else arrays[key]
    np.testing.assert_array_equal(value, expected, err_msg=key)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_bitwise_equal_means_the_same_bits(dtype):
  """-0.0 against a golden 0.0 is equal in value, not in bits: CHANGED. A NaN where the
  golden has the same NaN is bitwise equal: PASS. bfloat16 (numpy kind 'V') too."""
  zeros = np.zeros((4, 4), dtype)
  r = _verdict(zeros, -zeros)
  assert r.status == golden.CHANGED, r
  with_nan = np.linspace(0.5, 2.0, 16, dtype=np.float32).reshape(4, 4)
  with_nan[1, 2] = np.nan
  with_nan = with_nan.astype(dtype)
  r = _verdict(with_nan.copy(), with_nan)
  assert r.status == golden.PASS and r.detail == "bitwise equal", r


def test_the_stored_reduction_length_scales_the_bound():
  """Off by 5 atol everywhere: within atol * sqrt(100) of a 100-long reduction, not of 1."""
  out = np.zeros((8, 8), np.float32)
  off = out + np.float32(5 * F32["atol"])

  def verdict(length):
    result = _result(out)
    result.entry["reduction_length"] = length
    return golden._compare_to_golden(result, off)

  assert verdict(100).status == golden.CHANGED
  assert verdict(1).status == golden.FAIL


def test_goldens_of_another_family_are_not_made_here(tmp_path):
  other = "h100" if FAMILY != "h100" else "cpu"
  with pytest.raises(ValueError, match="cannot be made"):
    golden.regenerate(other, data_dir=str(tmp_path), ops=["layer_norm"])
  assert golden.load(other, str(tmp_path)) is None


def test_merge_drops_the_goldens_a_part_no_longer_has(tmp_path):
  """A golden of a merged op that its part lacks (no longer produced) is not kept."""
  data = _copy_goldens(tmp_path)
  part = str(tmp_path / "part")
  shutil.copytree(os.path.join(data, FAMILY), os.path.join(part, FAMILY))
  manifest, arrays = golden.load(FAMILY, data)
  gone = "layer_norm.no_such_impl.case"
  arrays[gone] = np.zeros((2,), np.float32)
  manifest["entries"][gone] = dict(manifest["entries"][_float32_layer_norm_key(manifest)])
  golden.write(FAMILY, manifest, arrays, data)
  out = str(tmp_path / "out")
  golden.merge(FAMILY, {"layer_norm": part}, data_dir=data, out_dir=out)
  merged_manifest, merged = golden.load(FAMILY, out)
  assert gone not in merged and gone not in merged_manifest["entries"]
  assert set(merged) == set(arrays) - {gone}


def test_each_case_is_compared_with_its_own_reference():
  results = golden.compute(FAMILY, ops=["layer_norm"])
  ran = [r for r in results if not r.status]
  assert len({r.entry["case"] for r in ran}) > 1
  assert all(r.entry["reference_ok"] for r in ran), [
    r.key for r in ran if not r.entry["reference_ok"]
  ]


def test_an_implementation_without_a_golden_is_missing_not_passed(tmp_path):
  manifest, _ = golden.load(FAMILY)
  key = _float32_layer_norm_key(manifest)
  (r,), stored = golden.check(FAMILY, data_dir=str(tmp_path), keys=[key])
  assert stored is None and r.status == golden.MISSING, (r.status, r.detail)


def break_xla(monkeypatch):
  """Plants an import error in every op's xla implementation (`golden.implementations`)."""
  real = golden.implementations

  def broken(op, profile):
    return [
      dataclasses.replace(i, error="ImportError: planted") if i.name == "xla" else i
      for i in real(op, profile)
    ]

  monkeypatch.setattr(golden, "implementations", broken)


def test_a_broken_implementation_is_an_error_not_a_skip(monkeypatch):
  manifest, _ = golden.load(FAMILY)
  key = _float32_layer_norm_key(manifest)
  break_xla(monkeypatch)
  (r,) = golden.compute(FAMILY, keys=[key])
  assert r.status == golden.ERROR and "planted" in r.detail, (r.status, r.detail)


def test_goldens_are_written_byte_for_byte_the_same(tmp_path, monkeypatch):
  """The same goldens give the same file bytes whatever the clock and the arrays' order, so a
  regeneration that changes nothing leaves no diff (fixed zip timestamps, sorted members)."""
  manifest = {"family": FAMILY, "entries": {}}
  a = np.arange(6, dtype=np.float32).reshape(2, 3)
  b = np.asarray([1.5, -2.25], dtype=jnp.bfloat16)
  golden.write(FAMILY, manifest, {"op.a": a, "op.b": b}, str(tmp_path / "one"))
  monkeypatch.setattr(time, "time", lambda: 1.9e9)  # Some years later, for zipfile's clock.
  golden.write(FAMILY, manifest, {"op.b": b, "op.a": a}, str(tmp_path / "two"))
  one, two = (tmp_path / d / FAMILY / golden.NPZ for d in ("one", "two"))
  assert one.read_bytes() == two.read_bytes()
  with zipfile.ZipFile(one) as z:
    assert [i.filename for i in z.infolist()] == ["op.a.npy", "op.b.npy"]
    assert {i.date_time for i in z.infolist()} == {(1980, 1, 1, 0, 0, 0)}
