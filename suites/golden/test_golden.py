"""Golden values: the committed goldens of the hardware at hand, and the checker's teeth."""

import os
import shutil

import numpy as np
import pytest

from golden import __main__ as golden_cli
from golden import golden
from tokamax_harness import hardware

FAMILY = hardware.detect().family


def _keys() -> list:
  """(key, op, implementation) of every golden that should exist here."""
  profile = hardware.detect()
  out = []
  for case in golden.cases(FAMILY):
    for impl in golden.implementations(case.op, profile):
      out.append(
        pytest.param(
          golden.entry_key(case, impl.name),
          marks=pytest.mark.op(case.op, impl.name),
          id=golden.entry_key(case, impl.name),
        )
      )
  return out


@pytest.mark.parametrize("key", _keys())
def test_golden(key):
  # One entry per test: test workers share the goldens out, none computes them all.
  results, manifest = golden.check(FAMILY, keys=[key])
  if manifest is None:
    pytest.skip(
      f"MISSING goldens: none committed for hardware family {FAMILY!r} "
      f"({golden.family_dir(FAMILY)}); make them with `nox -s golden -- --regen` there"
    )
  (r,) = results
  if r.status == golden.SKIP:
    pytest.skip(r.detail)
  assert r.status in (golden.PASS, golden.CHANGED), f"{r.status} {key}: {r.detail}"


def _scaled(factor):
  def override(case, impl):
    return lambda *a, **k: impl(*a, **k) * factor

  return override


def test_planted_numerics_change_fails_the_check():
  results, manifest = golden.check(FAMILY, ops=["layer_norm"], override=_scaled(1.1))
  assert manifest is not None
  ran = [r for r in results if r.status != golden.SKIP]
  assert ran, "no layer_norm golden ran"
  assert all(r.status == golden.FAIL for r in ran), golden.table(ran, title="planted")
  assert "FAILED" in ran[0].detail and "max abs error" in ran[0].detail


def test_unplanted_check_passes_for_the_same_op():
  results, _ = golden.check(FAMILY, ops=["layer_norm"], override=_scaled(1.0))
  assert all(r.status in (golden.PASS, golden.CHANGED, golden.SKIP) for r in results)


def test_no_goldens_for_the_family_is_reported(tmp_path, capsys):
  results, manifest = golden.check(FAMILY, data_dir=str(tmp_path), ops=["layer_norm"])
  assert manifest is None
  assert {r.status for r in results} <= {golden.MISSING, golden.SKIP}
  assert any(r.status == golden.MISSING for r in results)
  assert golden_cli.main(["--data", str(tmp_path), "--ops", "layer_norm"]) == 1
  out = capsys.readouterr().out
  assert "MISSING: no goldens for hardware family" in out


def test_one_missing_golden_fails(tmp_path, capsys):
  shutil.copytree(golden.family_dir(FAMILY), os.path.join(tmp_path, FAMILY))
  manifest, arrays = golden.load(FAMILY, str(tmp_path))
  victim = next(k for k in sorted(arrays) if k.startswith("layer_norm."))
  del arrays[victim], manifest["entries"][victim]
  golden.write(FAMILY, manifest, arrays, str(tmp_path))
  assert golden_cli.main(["--data", str(tmp_path), "--ops", "layer_norm"]) == 1
  out = capsys.readouterr().out
  assert f"MISSING  {victim}" in out and "FAILED: 1 golden(s)" in out


def test_regen_prints_what_changed(tmp_path, capsys):
  data = str(tmp_path)
  assert golden_cli.main(["--regen", "--data", data, "--ops", "layer_norm"]) == 0
  first = capsys.readouterr().out
  assert "NEW" in first
  manifest, arrays = golden.load(FAMILY, data)
  changed = sorted(arrays)[0]
  arrays[changed] = (arrays[changed].astype(np.float32) * 1.5).astype(arrays[changed].dtype)
  golden.write(FAMILY, manifest, arrays, data)
  assert golden_cli.main(["--regen", "--data", data, "--ops", "layer_norm"]) == 0
  second = capsys.readouterr().out
  assert f"FAIL     {changed}" in second, second
  assert "PASS" in second and "NEW" not in second
  # The regenerated goldens hold the fresh values again.
  assert golden_cli.main(["--data", data, "--ops", "layer_norm"]) == 0


def test_parallel_regen_merges_each_ops_goldens(tmp_path, capsys):
  data = str(tmp_path)
  shutil.copytree(golden.family_dir(FAMILY), os.path.join(data, FAMILY))
  manifest, arrays = golden.load(FAMILY, data)
  planted = {k: v * 2 for k, v in arrays.items() if k.startswith(("layer_norm.", "ragged_dot."))}
  golden.write(FAMILY, manifest, {**arrays, **planted}, data)
  args = ["--regen", "--jobs", "2", "--data", data, "--ops", "layer_norm,gated_linear_unit"]
  assert golden_cli.main(args) == 0
  capsys.readouterr()
  _, merged = golden.load(FAMILY, data)
  assert sorted(merged) == sorted(arrays)
  for key, value in merged.items():
    if key.startswith("ragged_dot."):  # Not regenerated: kept bit for bit.
      np.testing.assert_array_equal(value, planted[key], err_msg=key)
    else:  # Fresh values (on a GPU not always bitwise the stored ones), not the planted ones.
      fresh, stored = (np.asarray(a, np.float32) for a in (value, arrays[key]))
      np.testing.assert_allclose(fresh, stored, rtol=1e-2, atol=1e-2, err_msg=key)


def _committed_families() -> list[str]:
  return sorted(
    f
    for f in os.listdir(golden.DATA_DIR)
    if os.path.exists(os.path.join(golden.DATA_DIR, f, golden.MANIFEST))
  )


@pytest.mark.parametrize("family", _committed_families())
def test_committed_goldens_are_whole_and_agree_with_the_reference(family):
  """Every family's goldens (made on its hardware) against the reference computed here."""
  from suites.matrices import cases as cases_lib
  from suites.matrices import checks
  from tokamax_harness import compare, tolerance

  manifest, arrays = golden.load(family)
  for field in ("family", "device_kind", "jax_version", "commit", "date", "entries"):
    assert manifest.get(field), f"{family} manifest lacks {field}"
  assert set(arrays) == set(manifest["entries"]), "npz and manifest disagree"
  references = {}
  for key, entry in manifest["entries"].items():
    out = arrays[key]
    assert list(out.shape) == entry["out_shape"] and golden._digest(out) == entry["sha256"], key
    case = cases_lib.Case(
      entry["op"],
      cases_lib.shape_key(
        {k: tuple(v) if isinstance(v, list) else v for k, v in entry["shape"].items()}
      ),
      entry["dtype"],
      entry["feature"],
      family,
      "golden",
    )
    assert case.id == entry["case"], key
    if case.id not in references:
      args, kwargs = case.make_args(checks.case_key(case))
      references[case.id] = np.asarray(case.reference(args, kwargs))
    report = compare.compare(
      out,
      references[case.id],
      tol=tolerance.Tolerance(**entry["tolerance"]),
      reduction_length=entry["reduction_length"],
      name=key,
    )
    assert report.ok == entry["reference_ok"], report.message
