"""What a golden entry records, which cases and implementations get one, and the CLI's verdicts.

The expectations are written out here (the cases of an op, the float32 row,
a layer norm's reduction length, a digest computed with hashlib) or come from
the harness reference, never from the code under test.
"""

import dataclasses
import hashlib
import os
import shutil

import jax
import numpy as np
import pytest

from golden import __main__ as golden_cli
from golden import golden
from suites.golden import test_golden_rules
from suites.matrices import checks
from tokamax_harness import hardware

FAMILY = hardware.detect().family
LAYER_NORM_FEATURES = {"plain", "rms", "axis0", "no_scale_offset", "scale_offset", "large_epsilon"}


def _layer_norm_case(feature="axis0", dtype="float32"):
  (case,) = [
    c for c in golden.cases(FAMILY, ["layer_norm"]) if c.feature == feature and c.dtype == dtype
  ]
  return case


def _key(case, impl="xla"):
  return golden.entry_key(case, impl)


def test_the_cases_are_every_feature_in_every_dtype_at_the_golden_shape():
  cases = golden.cases("cpu", ["layer_norm"])
  got = sorted((c.feature, c.dtype) for c in cases)
  assert got == sorted((f, d) for f in LAYER_NORM_FEATURES for d in ("float32", "bfloat16"))
  assert all(dict(c.shape) == {"d": 256, "rows": (64,)} for c in cases)
  assert len({c.id for c in cases}) == 12


def test_interpret_mode_kernels_have_no_goldens():
  profile = hardware.detect()
  got = {op: [i.name for i in golden.implementations(op, profile)] for op in golden.opdb.OPS}
  assert not [
    (op, i.name)
    for op in golden.opdb.OPS
    for i in golden.implementations(op, profile)
    if i.interpret
  ]
  if FAMILY == "cpu":  # Only the native XLA implementations (cuDNN: a SKIP here).
    assert got == {
      "dot_product_attention": ["xla", "xla_chunked", "cudnn"],
      "layer_norm": ["xla"],
      "gated_linear_unit": ["xla"],
      "ragged_dot": ["xla"],
      "linear_softmax_cross_entropy_loss": ["xla", "chunked_xla"],
    }


def test_a_golden_is_one_output_array():
  a = np.arange(3.0)
  np.testing.assert_array_equal(golden._single([a]), a)
  with pytest.raises(ValueError, match="one output array"):
    golden._single((a, a + 1))


def test_a_fresh_entry_records_the_output_its_digest_tolerance_and_reduction_length():
  case = _layer_norm_case()
  (r,) = golden.compute(FAMILY, keys=[_key(case)])
  assert r.status == "" and r.output.dtype == np.float32, (r.status, r.detail)
  e = r.entry
  assert (e["op"], e["implementation"], e["case"], e["feature"]) == (
    "layer_norm",
    "xla",
    case.id,
    "axis0",
  )
  # axis0 normalises over the 256-long axis, which comes first.
  assert e["out_shape"] == [256, 64] and e["out_dtype"] == "float32"
  assert e["reduction_length"] == 256
  digest = hashlib.sha256(np.ascontiguousarray(r.output).tobytes()).hexdigest()[:16]
  assert e["sha256"] == digest
  # The float32 row, not a gradient's or a matmul's.
  assert (e["tolerance"]["atol"], e["tolerance"]["rtol"]) == (2e-6, 1e-5)
  assert e["reference_ok"] is True and 0 <= e["reference_max_error"] < 1e-4


def test_a_fresh_entry_records_the_outputs_error_against_the_reference():
  """An output 10% off: its entry says so (max error 0.1 max |reference|, not ok)."""
  case = _layer_norm_case("plain")
  args, kwargs = case.make_args(checks.case_key(case))
  reference = np.asarray(case.reference(args, kwargs), np.float64)

  def off(case, impl):
    return lambda *a, **k: impl(*a, **k) * 1.1

  (r,) = golden.compute(FAMILY, keys=[_key(case)], override=off)
  assert r.entry["reference_ok"] is False
  expected = 0.1 * np.max(np.abs(reference))
  assert r.entry["reference_max_error"] == pytest.approx(expected, rel=1e-3)


def test_a_matmul_case_is_checked_with_the_accelerator_float32_matmul_row():
  (matmul,) = [
    c
    for c in golden.cases("cpu", ["ragged_dot"])
    if c.dtype == "float32" and c.feature == "default"
  ]
  elementwise = _layer_norm_case("plain")
  tol = golden._tolerance(matmul, "gpu")
  assert (tol.atol, tol.rtol) == (5e-4, 2e-3)
  tol = golden._tolerance(elementwise, "gpu")
  assert (tol.atol, tol.rtol) == (2e-6, 1e-5)
  tol = golden._tolerance(matmul, "cpu")
  assert (tol.atol, tol.rtol) == (2e-6, 1e-5)


def test_a_fresh_matmul_entry_on_a_gpu_records_the_accelerator_row(monkeypatch):
  """`compute` asks for the tolerance of the platform it runs on: a float32 ragged_dot made on a
  GPU (faked: the XLA implementation, run here) is stored with the TF32 row (5e-4, 2e-3)."""
  (case,) = [
    c
    for c in golden.cases(FAMILY, ["ragged_dot"])
    if c.dtype == "float32" and c.feature == "default"
  ]
  gpu = dataclasses.replace(hardware.detect(), platform="gpu")
  monkeypatch.setattr(golden.hardware, "detect", lambda: gpu)
  (r,) = golden.compute(FAMILY, keys=[_key(case)])
  assert r.status == "", r.detail
  assert (r.entry["tolerance"]["atol"], r.entry["tolerance"]["rtol"]) == (5e-4, 2e-3)


def _copy_goldens(tmp_path, name="data") -> str:
  data = str(tmp_path / name)
  shutil.copytree(golden.family_dir(FAMILY), os.path.join(data, FAMILY))
  return data


def test_regenerated_goldens_carry_this_commit_and_jax_version(tmp_path, monkeypatch):
  data = _copy_goldens(tmp_path)
  old, _ = golden.load(FAMILY, data)
  sha = "ab" * 20
  assert old["commit"] != sha
  monkeypatch.setenv("GITHUB_SHA", sha)
  golden.regenerate(FAMILY, data_dir=data, ops=["layer_norm"])
  manifest, _ = golden.load(FAMILY, data)
  assert manifest["commit"] == sha
  assert manifest["jax_version"] == jax.__version__
  assert manifest["family"] == FAMILY
  assert manifest["device_kind"] == jax.devices()[0].device_kind


def test_merge_takes_the_metadata_of_the_regenerated_parts(tmp_path):
  data = _copy_goldens(tmp_path)
  part = _copy_goldens(tmp_path, "part")
  manifest, arrays = golden.load(FAMILY, part)
  manifest["commit"], manifest["jax_version"] = "part-commit", "9.9.9"
  golden.write(FAMILY, manifest, arrays, part)
  out = str(tmp_path / "out")
  golden.merge(FAMILY, {"layer_norm": part}, data_dir=data, out_dir=out)
  merged, _ = golden.load(FAMILY, out)
  assert (merged["commit"], merged["jax_version"]) == ("part-commit", "9.9.9")


def test_table_lists_failures_first_and_counts_every_status():
  R = golden.Result
  results = [
    R("b.key", golden.PASS, "bitwise equal"),
    R("a.key", golden.FAIL, "first line\nsecond line"),
    R("c.key", golden.PASS, "bitwise equal"),
    R("d.key", golden.MISSING, "no golden"),
  ]
  lines = golden.table(results, title="T").splitlines()
  assert lines[0] == "T"
  body = [line.split() for line in lines[3:-1]]
  assert body == [
    ["FAIL", "a.key", "first", "line"],
    ["second", "line"],
    ["MISSING", "d.key", "no", "golden"],
    ["PASS", "b.key", "bitwise", "equal"],
    ["PASS", "c.key", "bitwise", "equal"],
  ]
  assert lines[-1] == "totals: FAIL 1, MISSING 1, PASS 2"


def test_cli_check_fails_on_an_error(monkeypatch, capsys):
  test_golden_rules.break_xla(monkeypatch)
  assert golden_cli.main(["--ops", "layer_norm"]) == 1
  out = capsys.readouterr().out
  # Every float32 and bfloat16 layer_norm case of the xla implementation errors.
  errors = len(golden.cases(FAMILY, ["layer_norm"]))
  assert "ERROR" in out and f"FAILED: {errors} golden(s)" in out, out


def test_cli_regen_fails_on_an_error(tmp_path, monkeypatch, capsys):
  test_golden_rules.break_xla(monkeypatch)
  assert golden_cli.main(["--regen", "--data", str(tmp_path), "--ops", "layer_norm"]) == 1
  assert "ERROR" in capsys.readouterr().out


def _files(d):
  return {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d))}


def test_regen_keeps_the_stored_goldens_of_cases_that_errored(tmp_path, monkeypatch):
  """A planted import error in xla: its layer_norm cases are ERROR, not REMOVED, and their
  stored goldens are written back bit for bit (the next check still has them)."""
  data = _copy_goldens(tmp_path)
  _, before = golden.load(FAMILY, data)
  xla_keys = {k for k in before if k.startswith("layer_norm.xla.")}
  assert xla_keys
  test_golden_rules.break_xla(monkeypatch)
  changes = golden.regenerate(FAMILY, data_dir=data, ops=["layer_norm"])
  statuses = {r.key: r.status for r in changes}
  assert {statuses[k] for k in xla_keys} == {golden.ERROR}
  assert golden.REMOVED not in statuses.values()
  manifest, after = golden.load(FAMILY, data)
  for key in xla_keys:
    np.testing.assert_array_equal(after[key], before[key], err_msg=key)
    assert manifest["entries"][key]["op"] == "layer_norm"


def test_cli_regen_writes_to_out_and_leaves_the_data_alone(tmp_path, capsys):
  data = _copy_goldens(tmp_path)
  manifest, arrays = golden.load(FAMILY, data)
  planted = {k: (v * 2 if k.startswith("layer_norm.") else v) for k, v in arrays.items()}
  golden.write(FAMILY, manifest, planted, data)
  before = _files(golden.family_dir(FAMILY, data))
  out = str(tmp_path / "out")
  assert golden_cli.main(["--regen", "--data", data, "--out", out, "--ops", "layer_norm"]) == 0
  capsys.readouterr()
  assert _files(golden.family_dir(FAMILY, data)) == before
  _, fresh = golden.load(FAMILY, out)
  assert set(fresh) == set(arrays)
  for key, value in fresh.items():
    expected = arrays[key]  # Fresh layer_norm values (the unplanted ones), others kept.
    np.testing.assert_allclose(
      np.asarray(value, np.float32), np.asarray(expected, np.float32), rtol=1e-2, atol=1e-2
    )


def test_cli_parallel_regen_with_no_part_written_fails_and_writes_nothing(tmp_path, capsys):
  data = _copy_goldens(tmp_path)
  before = _files(golden.family_dir(FAMILY, data))
  args = ["--regen", "--jobs", "2", "--data", data, "--ops", "no_such_op,nor_this_one"]
  assert golden_cli.main(args) == 1
  assert "FAILED: no goldens written for ['no_such_op', 'nor_this_one']" in capsys.readouterr().out
  assert _files(golden.family_dir(FAMILY, data)) == before


def test_cli_parallel_regen_fails_when_a_part_fails_and_shares_the_memory(
  tmp_path, capsys, monkeypatch
):
  """One process per op (faked here: each writes the stored goldens as its part); a part that
  writes its goldens but exits 1 (an ERROR case) fails the run after the merge, and each of the
  two processes side by side may take 0.9 / 2 of the device memory."""
  data = _copy_goldens(tmp_path)
  calls = []

  def fake_run(cmd, env, **kwargs):
    op, out = cmd[cmd.index("--ops") + 1], cmd[cmd.index("--out") + 1]
    calls.append((op, env["XLA_PYTHON_CLIENT_MEM_FRACTION"], env["XLA_PYTHON_CLIENT_PREALLOCATE"]))
    shutil.copytree(golden.family_dir(FAMILY, data), golden.family_dir(FAMILY, out))
    return golden_cli.subprocess.CompletedProcess(cmd, int(op == "layer_norm"), "", "")

  monkeypatch.setattr(golden_cli.subprocess, "run", fake_run)
  args = ["--regen", "--jobs", "2", "--data", data, "--ops", "layer_norm,gated_linear_unit"]
  assert golden_cli.main(args) == 1
  assert "merged the goldens of 2 ops" in capsys.readouterr().out
  assert sorted(calls) == [
    ("gated_linear_unit", "0.450", "false"),
    ("layer_norm", "0.450", "false"),
  ]
