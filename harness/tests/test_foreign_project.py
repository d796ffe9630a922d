"""`-p harness` in another project: that project's Hypothesis settings stay its own."""

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


def _run(pytester, *args):
  result = pytester.runpytest_subprocess("-p", "harness", "-p", "no:cacheprovider", "-s", *args)
  result.assert_outcomes(passed=1)
  return result


def test_foreign_project_keeps_hypothesis_defaults(foreign):
  _run(foreign).stdout.fnmatch_lines(["*MAX_EXAMPLES 100 DERANDOMIZE False*"])


def test_ini_option_loads_a_harness_profile(foreign):
  foreign.makeini("[pytest]\nharness_hypothesis_profile = ci\n")
  _run(foreign).stdout.fnmatch_lines(["*MAX_EXAMPLES 12 DERANDOMIZE True*"])


def test_hypothesis_profile_option_wins(foreign):
  foreign.makeini("[pytest]\nharness_hypothesis_profile = ci\n")
  _run(foreign, "--hypothesis-profile", "nightly").stdout.fnmatch_lines(
    ["*MAX_EXAMPLES 200 DERANDOMIZE False*"]
  )
