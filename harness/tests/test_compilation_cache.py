"""TOKAMAX_COMPILATION_CACHE: the plugin puts JAX's persistent cache and Triton's cache there."""

pytest_plugins = ["pytester"]

_TEST = """
import os

import jax


def test_compiles():
  assert jax.jit(lambda x: x * 3 + 1)(2.0) == 7.0
  print("TRITON_CACHE_DIR=" + os.environ["TRITON_CACHE_DIR"])
"""


def test_cache_dirs_fill(pytester, monkeypatch, tmp_path):
  monkeypatch.setenv("TOKAMAX_COMPILATION_CACHE", str(tmp_path / "cache"))
  monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
  pytester.makepyfile(test_inner=_TEST)
  result = pytester.runpytest_subprocess("-p", "tokamax_harness", "-p", "no:cacheprovider", "-s")
  result.assert_outcomes(passed=1)
  result.stdout.fnmatch_lines([f"*compilation caches in {tmp_path / 'cache'}*"])
  result.stdout.fnmatch_lines([f"*TRITON_CACHE_DIR={tmp_path / 'cache' / 'triton'}*"])
  # Every compile is written, however small and quick (a suite's programs are mostly small).
  assert list((tmp_path / "cache" / "jax").iterdir())


def test_no_cache_without_the_variable(pytester, monkeypatch):
  monkeypatch.delenv("TOKAMAX_COMPILATION_CACHE", raising=False)
  pytester.makepyfile(test_inner=_TEST.replace('print("TRITON', '# print("TRITON'))
  result = pytester.runpytest_subprocess("-p", "tokamax_harness", "-p", "no:cacheprovider")
  result.assert_outcomes(passed=1)
  assert "compilation caches" not in result.stdout.str()
