"""`-p tokamax_harness` in another project: its Hypothesis settings stay its own; no tokamax wording."""

import pathlib
import shutil

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
  harness = ("-p", "tokamax_harness") if plugin else ()
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


_FAILING_PROPERTY = """
from hypothesis import given, strategies as st

@given(st.integers(min_value=0))
def test_property(x):
  assert x < 10
"""


@pytest.mark.parametrize("profile", ["harness-ci", "harness-nightly", "harness-dev"])
def test_harness_profiles_print_the_reproduction_blob(foreign, profile):
  """A property test failing under a harness profile prints the `@reproduce_failure(...)`
  decorator that replays its example (the nightly draws fresh examples every run)."""
  foreign.makepyfile(test_property=_FAILING_PROPERTY)
  result = foreign.runpytest_subprocess(
    "-p",
    "tokamax_harness",
    "-p",
    "no:cacheprovider",
    "--hypothesis-profile",
    profile,
    "test_property.py",
  )
  result.assert_outcomes(failed=1)
  result.stdout.fnmatch_lines(["*@reproduce_failure(*"])


_BENCH = """
import pathlib
import shutil

import pytest

@pytest.mark.bench
def test_timed():
  pass
"""


def test_foreign_summary_has_no_tokamax_wording(foreign):
  foreign.makepyfile(test_bench=_BENCH)
  result = foreign.runpytest_subprocess("-p", "tokamax_harness", "-p", "no:cacheprovider", "-rs")
  result.assert_outcomes(passed=1, skipped=1)
  result.stdout.fnmatch_lines(["*= test summary =*", "*benchmark; run with --bench"])
  assert "tokamax summary" not in result.stdout.str()
  assert "nox" not in result.stdout.str()


def test_ini_options_set_title_and_bench_hint(foreign):
  foreign.makepyfile(test_bench=_BENCH)
  foreign.makeini(
    "[pytest]\nharness_summary_title = proj summary\nharness_bench_hint = make bench\n"
  )
  result = foreign.runpytest_subprocess("-p", "tokamax_harness", "-p", "no:cacheprovider", "-rs")
  result.assert_outcomes(passed=1, skipped=1)
  result.stdout.fnmatch_lines(["*= proj summary =*", "*benchmark; run with --bench (make bench)*"])


_TIMEOUT_MARKED = """
import pytest

@pytest.mark.timeout(60)
def test_marked():
  pass
"""


def test_timeout_marker_is_known_without_pytest_timeout(pytester):
  """A project without pytest-timeout may still mark tests `timeout` under --strict-markers:
  the harness registers the marker (a no-op) where that plugin is absent."""
  pytester.makepyfile(test_marked=_TIMEOUT_MARKED)
  args = ("-p", "no:cacheprovider", "-p", "no:timeout")
  harness = pytester.runpytest_subprocess("-p", "tokamax_harness", *args, "--markers")
  plain = pytester.runpytest_subprocess(*args, "--markers")  # Not registered without it.
  registered = lambda r: any(line.startswith("@pytest.mark.timeout(") for line in r.stdout.lines)
  assert registered(harness) and not registered(plain)
  result = pytester.runpytest_subprocess("-p", "tokamax_harness", *args, "--strict-markers")
  result.assert_outcomes(passed=1)


_STANDALONE = """
import importlib
import pkgutil
import sys

import jax
import jax.numpy as jnp
import pathlib
import shutil

import pytest

import tokamax_harness
from tokamax_harness import compare, references


def test_the_harness_alone(hardware, rng_key):
  assert sys.modules.get("tokamax") is None  # Blocked: the harness must not need it.
  for m in pkgutil.iter_modules(tokamax_harness.__path__):
    importlib.import_module("tokamax_harness." + m.name)
  print("HARNESS_FROM", tokamax_harness.__file__)
  x = jax.random.normal(rng_key, (8, 32))
  mine = (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-6)
  ref = references.layer_norm(x, jnp.ones(32), jnp.zeros(32))
  compare.assert_close(mine, ref, dtype=jnp.float32, reduction_length=32)
  with pytest.raises(AssertionError):
    compare.assert_close(mine * 1.01, ref, dtype=jnp.float32, reduction_length=32)
  assert hardware.platform == jax.default_backend()
"""


def test_installed_alone_under_its_own_name(pytester, monkeypatch, tmp_path):
  """The harness's files as the package `tokamax_harness` (what `pip install ./harness`
  installs), with tokamax blocked: every module imports, fixtures and comparators work."""
  site = tmp_path / "site"
  package = site / "tokamax_harness"
  package.mkdir(parents=True)
  source = pathlib.Path(__file__).resolve().parents[1]
  for path in source.glob("*.py"):
    shutil.copy(path, package / path.name)
  (site / "sitecustomize.py").write_text("import sys\nsys.modules['tokamax'] = None\n")
  monkeypatch.setenv("PYTHONPATH", str(site))
  monkeypatch.delenv("TOKAMAX_HYPOTHESIS_PROFILE", raising=False)
  pytester.makepyfile(test_alone=_STANDALONE)
  result = pytester.runpytest_subprocess("-p", "tokamax_harness", "-p", "no:cacheprovider", "-s")
  result.assert_outcomes(passed=1)
  result.stdout.fnmatch_lines([f"*HARNESS_FROM {package}/__init__.py*"])
