"""`-p harness` in another project: its Hypothesis settings stay its own; no tokamax wording."""

import pytest

pytest_plugins = ["pytester"]

_TEST = """
import hypothesis

def test_settings():
  s = hypothesis.settings.default
  print("MAX_EXAMPLES", s.max_examples, "DERANDOMIZE", s.derandomize)
"""


@pytest.fixture
def foreign(pytester, monkeypatch):
  monkeypatch.delenv("TOKAMAX_HYPOTHESIS_PROFILE", raising=False)
  pytester.makepyfile(test_foreign=_TEST)
  return pytester


def _run(pytester, *args, plugin=True):
  harness = ("-p", "harness") if plugin else ()
  result = pytester.runpytest_subprocess(*harness, "-p", "no:cacheprovider", "-s", *args)
  result.assert_outcomes(passed=1)
  return result


def _settings_line(result) -> str:
  return next(line for line in result.stdout.lines if "MAX_EXAMPLES" in line)


def test_foreign_project_keeps_hypothesis_defaults(foreign):
  # Hypothesis's defaults depend on the environment (its own "ci" profile where CI is set).
  without = _settings_line(_run(foreign, plugin=False))
  assert _settings_line(_run(foreign)) == without


def test_ini_option_loads_a_harness_profile(foreign):
  foreign.makeini("[pytest]\nharness_hypothesis_profile = harness-ci\n")
  _run(foreign).stdout.fnmatch_lines(["*MAX_EXAMPLES 12 DERANDOMIZE True*"])


def test_hypothesis_profile_option_wins(foreign):
  foreign.makeini("[pytest]\nharness_hypothesis_profile = harness-ci\n")
  _run(foreign, "--hypothesis-profile", "harness-nightly").stdout.fnmatch_lines(
    ["*MAX_EXAMPLES 200 DERANDOMIZE False*"]
  )


_BENCH = """
import pytest

@pytest.mark.bench
def test_timed():
  pass
"""


def test_foreign_summary_has_no_tokamax_wording(foreign):
  foreign.makepyfile(test_bench=_BENCH)
  result = foreign.runpytest_subprocess("-p", "harness", "-p", "no:cacheprovider", "-rs")
  result.assert_outcomes(passed=1, skipped=1)
  result.stdout.fnmatch_lines(["*= test summary =*", "*benchmark; run with --bench"])
  assert "tokamax summary" not in result.stdout.str()
  assert "nox" not in result.stdout.str()


def test_ini_options_set_title_and_bench_hint(foreign):
  foreign.makepyfile(test_bench=_BENCH)
  foreign.makeini(
    "[pytest]\nharness_summary_title = proj summary\nharness_bench_hint = make bench\n"
  )
  result = foreign.runpytest_subprocess("-p", "harness", "-p", "no:cacheprovider", "-rs")
  result.assert_outcomes(passed=1, skipped=1)
  result.stdout.fnmatch_lines(["*= proj summary =*", "*benchmark; run with --bench (make bench)*"])
