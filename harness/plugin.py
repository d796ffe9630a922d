"""The pytest plugin: fixtures, markers, options, Hypothesis profiles, summary.

Load it with `-p tokamax_harness`. Fixtures: `hardware` (the `Profile`), `rng_key` (a
random key seeded from the test id), `interpret` (whether Pallas kernels run
in interpret mode: on CPU). Markers: `requires(*features)` skips with the
missing feature named; `long` runs only with `--run-long` (nightly); `gpu` and
`tpu` run only there; `bench` runs only with `--bench`; `op(name,
implementation)` attributes a test to an op and implementation in the summary.
"""

import hashlib
import os

import jax
import pytest

from . import hardware, summary

# Features `requires(...)` understands, and the check each one makes.
_FEATURES = {
  "cpu": lambda p: p.platform == "cpu",
  "gpu": lambda p: p.platform == "gpu",
  "tpu": lambda p: p.platform == "tpu",
  "nvidia": lambda p: p.compute_capability is not None,
  "sm80": lambda p: p.compute_capability is not None and p.compute_capability >= (8, 0),
  "sm90": lambda p: p.compute_capability is not None and p.compute_capability >= (9, 0),
  "f64": lambda p: p.has_f64,
  "multi_device": lambda p: p.device_count > 1,
  hardware.TRITON: lambda p: p.can_run(hardware.TRITON),
  hardware.MOSAIC_GPU: lambda p: p.can_run(hardware.MOSAIC_GPU),
  hardware.MOSAIC_TPU: lambda p: p.can_run(hardware.MOSAIC_TPU),
  hardware.CUDNN: lambda p: p.can_run(hardware.CUDNN),
  hardware.INTERPRET: lambda p: p.can_run(hardware.INTERPRET),
}


def _register_hypothesis_profiles() -> None:
  try:
    import hypothesis
  except ImportError:
    return
  common = dict(deadline=None, print_blob=True, suppress_health_check=list(hypothesis.HealthCheck))
  # Prefixed names: Hypothesis loads its own "ci" profile by itself where CI is set, so a
  # harness profile named "ci" would reach every project that loads the plugin.
  hypothesis.settings.register_profile("harness-ci", max_examples=12, derandomize=True, **common)
  hypothesis.settings.register_profile(
    "harness-nightly", max_examples=200, derandomize=False, **common
  )
  hypothesis.settings.register_profile("harness-dev", max_examples=25, derandomize=False, **common)


# Registered only: a project that loads `-p tokamax_harness` keeps its own Hypothesis settings unless it
# asks for one of these (`pytest_configure` below).
_register_hypothesis_profiles()


def _load_hypothesis_profile(config) -> None:
  """Loads the profile this project asks for, if any.

  `--hypothesis-profile` (Hypothesis's own option) wins; then TOKAMAX_HYPOTHESIS_PROFILE; then the
  `harness_hypothesis_profile` ini option (tokamax's pyproject sets `harness-ci`). Neither set: nothing is
  loaded, and Hypothesis's settings stay what the project made them.
  """
  try:
    import hypothesis
  except ImportError:
    return
  if config.getoption("hypothesis_profile", None):
    return
  name = os.environ.get("TOKAMAX_HYPOTHESIS_PROFILE") or config.getini("harness_hypothesis_profile")
  if name:
    hypothesis.settings.load_profile(name)


def _enable_compilation_caches() -> None:
  """`TOKAMAX_COMPILATION_CACHE=DIR`: compile caches on disk, shared by every pytest(-xdist) process.

  JAX's persistent cache (XLA executables of every size and compile time, and XLA's GPU
  autotuning results, which jax keeps beside them) in DIR/jax, Triton's in DIR/triton unless
  TRITON_CACHE_DIR is set. Mosaic GPU kernels are cached in memory only (per process). Done at
  import, before anything compiles: jax reads the setting once, at its first compile.
  """
  path = os.environ.get("TOKAMAX_COMPILATION_CACHE")
  if not path:
    return
  os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(path, "triton"))
  jax.config.update("jax_compilation_cache_dir", os.path.join(path, "jax"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no size floor.


_enable_compilation_caches()


def pytest_addoption(parser):
  parser.addini(
    "harness_hypothesis_profile",
    "Hypothesis profile the harness loads (ci, nightly, dev); unset: none, the project's own stand",
    default="",
  )
  parser.addini(
    "harness_summary_title",
    "title of the per-op summary printed at the end of a run",
    default="test summary",
  )
  parser.addini(
    "harness_bench_hint",
    "how this project runs `bench` tests (e.g. a nox session), added to their skip reason",
    default="",
  )
  group = parser.getgroup("tokamax harness")
  group.addoption(
    "--run-long", action="store_true", default=False, help="run `long` (nightly) tests"
  )
  group.addoption("--bench", action="store_true", default=False, help="run `bench` (timed) tests")
  group.addoption(
    "--interpret",
    choices=("auto", "on", "off"),
    default="auto",
    help="run Pallas kernels in interpret mode: auto = on CPU only",
  )
  group.addoption("--summary-json", default=None, help="write the per-op summary as JSON here")
  group.addoption("--summary-md", default=None, help="write the per-op summary as Markdown here")
  group.addoption(
    "--resume-from",
    action="append",
    default=[],
    metavar="JUNIT",
    help="deselect the tests that passed or skipped in this JUnit XML of a run cut short (repeatable)",
  )


def pytest_configure(config):
  for line in (
    "requires(*features): skip unless the hardware has every feature "
    f"({', '.join(sorted(_FEATURES))})",
    "long: nightly-only; runs with --run-long or TOKAMAX_NIGHTLY=1",
    "gpu: runs on GPU only",
    "tpu: runs on TPU only",
    "bench: timed benchmark; runs with --bench",
    "op(name, implementation): the op and implementation a test checks (for the summary)",
  ):
    config.addinivalue_line("markers", line)
  if not config.pluginmanager.hasplugin("timeout"):  # pytest-timeout's marker, a no-op without it.
    config.addinivalue_line("markers", "timeout(seconds): per-test limit (needs pytest-timeout)")
  _load_hypothesis_profile(config)
  config.pluginmanager.register(summary.Collector(config), "tokamax-summary")


def pytest_collection_modifyitems(config, items):
  paths = config.getoption("--resume-from")
  if not paths:
    return
  done = set().union(*(summary.junit_finished_ids(path) for path in paths))
  finished = [summary.item_junit_id(item) in done for item in items]
  config.hook.pytest_deselected(items=[i for i, f in zip(items, finished, strict=True) if f])
  items[:] = [i for i, f in zip(items, finished, strict=True) if not f]


def pytest_report_header(config):
  cache = os.environ.get("TOKAMAX_COMPILATION_CACHE")
  return (
    f"tokamax harness: {hardware.detect().describe()}, runnable {sorted(hardware.detect().runnable)}"
    + (f", compilation caches in {cache}" if cache else "")
  )


def missing_features(features, profile: hardware.Profile) -> list[str]:
  unknown = [f for f in features if f not in _FEATURES]
  if unknown:
    raise ValueError(f"unknown features {unknown}; known: {sorted(_FEATURES)}")
  return [f for f in features if not _FEATURES[f](profile)]


def pytest_runtest_setup(item):
  profile = hardware.detect()
  for marker in item.iter_markers("requires"):
    missing = missing_features(marker.args, profile)
    if missing:
      pytest.skip(f"requires {', '.join(missing)}; this is {profile.describe()}")
  if item.get_closest_marker("gpu") and profile.platform != "gpu":
    pytest.skip(f"GPU test; this is {profile.describe()}")
  if item.get_closest_marker("tpu") and profile.platform != "tpu":
    pytest.skip(f"TPU test; this is {profile.describe()}")
  if item.get_closest_marker("long") and not (
    item.config.getoption("--run-long") or os.environ.get("TOKAMAX_NIGHTLY") == "1"
  ):
    pytest.skip("long (nightly) test; run with --run-long")
  if item.get_closest_marker("bench") and not item.config.getoption("--bench"):
    hint = item.config.getini("harness_bench_hint")
    pytest.skip("benchmark; run with --bench" + (f" ({hint})" if hint else ""))


@pytest.fixture(scope="session", name="hardware")
def hardware_fixture() -> hardware.Profile:
  """The hardware profile of the default device."""
  return hardware.detect()


def key_for(test_id: str) -> jax.Array:
  """A random key derived from a test id (stable across runs and machines)."""
  seed = int.from_bytes(hashlib.sha256(test_id.encode()).digest()[:4], "little")
  return jax.random.key(seed)


@pytest.fixture
def rng_key(request) -> jax.Array:
  """A random key seeded from the test's id."""
  return key_for(request.node.nodeid)


@pytest.fixture(scope="session")
def interpret(request) -> bool:
  """Whether Pallas kernels run in interpret mode (default: on CPU only)."""
  choice = request.config.getoption("--interpret")
  if choice == "auto":
    return hardware.detect().platform == "cpu"
  return choice == "on"
