"""Expands the matrix of the hardware at hand into test parameters.

A test marked `matrix(kind)` gets `case` and `impl` parameters:
- "forward": every case of the family's matrix x every implementation that
  compiles here, plus the interpret-mode cases x kernels in interpret mode
  (on CPU); with `--run-long`, the nightly shapes too.
- "gradient": the first shape of each op, every dtype and feature.
- "determinism": the first two features of each op at its first shape.
- "bench": the op database's benchmark calls x every implementation (`bench_case`).
Each op's config variants (`OpInfo.config_variants`) join its implementations.
Implementations that cannot run here appear as skips with their reason.
"""

import os

import pytest

from suites import matrices, opdb
from tokamax_harness import hardware


def pytest_configure(config):
  config.addinivalue_line("markers", "matrix(kind): parametrize with the hardware matrix's cases")
  config.addinivalue_line(
    "markers",
    "host_only: a check on the host CPU whatever the accelerator (kernels in their interpreters,"
    " TPU exports); the CPU suite runs it, the GPU suite (ci/gpu_suite.sh) deselects it",
  )


def _long_enabled(config) -> bool:
  return config.getoption("--run-long") or os.environ.get("TOKAMAX_NIGHTLY") == "1"


def _param(case, impl, case_id):
  marks = [pytest.mark.op(case.op, impl.name)]
  if impl.reason is not None:
    marks.append(pytest.mark.skip(reason=f"{impl.label}: {impl.reason}"))
  return pytest.param(case, impl, marks=marks, id=f"{case.op}[{impl.label}]-{case_id}")


def _pairs(kind: str, family: str, config):
  """(case, implementation) pairs for a test of `kind`."""
  profile = hardware.detect()
  params = []
  for op, info in opdb.ALL.items():
    impls = matrices.all_for(info.spec, profile, info.config_variants)
    native = [i for i in impls if not i.interpret]
    interpreted = [i for i in impls if i.interpret]
    if kind == "forward":
      cases = matrices.for_family(family, op=op)
      if _long_enabled(config):
        cases += matrices.for_family(family, op=op, kind=matrices.LONG)
      params += [_param(c, i, c.id) for i in native for c in cases]
      params += [
        _param(c, i, c.id)
        for i in interpreted
        for c in matrices.for_family(family, op=op, kind=matrices.INTERPRET)
      ]
    elif kind in ("gradient", "determinism"):
      cases = matrices.gradient_cases(family, op=op)
      icases = matrices.gradient_cases(family, op=op, kind=matrices.INTERPRET)
      if kind == "determinism":
        keep = set(list(info.features)[:2])
        cases = [c for c in cases if c.feature in keep]
        icases = [c for c in icases if c.feature in keep]
      params += [_param(c, i, c.id) for i in native for c in cases]
      params += [_param(c, i, c.id) for i in interpreted for c in icases]
    elif kind == "bench":
      params += [
        _param(b, i, b.id)
        for i in native
        if i.variant is None
        for b in matrices.bench_cases(family, op=op)
      ]
    else:
      raise ValueError(f"unknown matrix kind {kind!r}")
  return params


def pytest_generate_tests(metafunc):
  marker = metafunc.definition.get_closest_marker("matrix")
  if marker is None:
    return
  kind = marker.args[0]
  first = "bench_case" if kind == "bench" else "case"
  metafunc.parametrize((first, "impl"), _pairs(kind, hardware.detect().family, metafunc.config))


# A whole CPU run skips about 8% of its tests (hardware and missing-dependency reasons); far
# more means a skip that swallows tests which should run.
MAX_SKIPPED_FRACTION = 0.2


def skipped_too_many(passed: int, skipped: int) -> str | None:
  """Why a whole run's outcome counts are implausible, or None.

  Args:
    passed: Tests that passed.
    skipped: Tests that were skipped.

  Returns:
    A reason when nothing passed or more than `MAX_SKIPPED_FRACTION` of the run was skipped.
  """
  if passed == 0:
    return "no test passed"
  if skipped > MAX_SKIPPED_FRACTION * (passed + skipped):
    return f"{skipped} of {passed + skipped} tests skipped (at most {MAX_SKIPPED_FRACTION:.0%})"
  return None


def _whole_run(config) -> bool:
  """Whether this is the README's unfiltered run over the testpaths, judged on xdist's controller."""
  return (
    config.args_source == pytest.Config.ArgsSource.TESTPATHS
    and not config.option.keyword
    and not config.option.markexpr
    and not config.option.collectonly
    and not hasattr(config, "workerinput")
  )


def pytest_sessionfinish(session, exitstatus):
  if exitstatus != pytest.ExitCode.OK or not _whole_run(session.config):
    return
  reporter = session.config.pluginmanager.get_plugin("terminalreporter")
  reason = skipped_too_many(
    len(reporter.stats.get("passed", [])), len(reporter.stats.get("skipped", []))
  )
  if reason is not None:
    reporter.write_sep("=", f"FAILED: implausible whole run: {reason}", red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
