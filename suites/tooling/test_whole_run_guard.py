"""The whole-run guard of suites/conftest.py: a run that skips most of its tests fails."""

import types

import pytest

from suites import conftest


def _session(passed, skipped, *, args_source=pytest.Config.ArgsSource.TESTPATHS, keyword=""):
  reporter = types.SimpleNamespace(
    stats={"passed": [object()] * passed, "skipped": [object()] * skipped},
    lines=[],
  )
  reporter.write_sep = lambda sep, line, **_: reporter.lines.append(line)
  config = types.SimpleNamespace(
    args_source=args_source,
    option=types.SimpleNamespace(keyword=keyword, markexpr="", collectonly=False),
    pluginmanager=types.SimpleNamespace(get_plugin=lambda name: reporter),
  )
  return types.SimpleNamespace(config=config, exitstatus=pytest.ExitCode.OK), reporter


@pytest.mark.parametrize(
  ("passed", "skipped", "fails"),
  [(5642, 466, False), (80, 20, False), (79, 21, True), (0, 0, True), (0, 5, True), (1, 0, False)],
)
def test_a_whole_run_fails_when_too_much_is_skipped(passed, skipped, fails):
  session, reporter = _session(passed, skipped)
  conftest.pytest_sessionfinish(session, pytest.ExitCode.OK)
  want = pytest.ExitCode.TESTS_FAILED if fails else pytest.ExitCode.OK
  assert session.exitstatus == want
  assert bool(reporter.lines) == fails


@pytest.mark.parametrize(
  "kwargs",
  [{"args_source": pytest.Config.ArgsSource.ARGS}, {"keyword": "ragged"}],
)
def test_a_filtered_run_may_skip_anything(kwargs):
  session, _ = _session(0, 50, **kwargs)
  conftest.pytest_sessionfinish(session, pytest.ExitCode.OK)
  assert session.exitstatus == pytest.ExitCode.OK


def test_a_failed_run_keeps_its_status():
  session, _ = _session(0, 50)
  session.exitstatus = pytest.ExitCode.TESTS_FAILED
  conftest.pytest_sessionfinish(session, pytest.ExitCode.TESTS_FAILED)
  assert session.exitstatus == pytest.ExitCode.TESTS_FAILED
