"""The hardware profile and the plugin's skips, for devices this host does not have.

`detect` reads a fake device (an H100, an A100, a T4, a TPU); the families,
the runnable implementation families and the features `requires(...)` checks
are pinned from the devices' data sheets. The plugin's skips (`long`, `bench`,
`gpu`, `requires`) are checked on stand-in test items.
"""

import dataclasses
import os
import types

import jax
import pytest

from tokamax_harness import hardware, plugin


@pytest.mark.parametrize(
  ("platform", "kind", "family"),
  [
    ("gpu", "NVIDIA H100 80GB HBM3", "h100"),
    ("gpu", "NVIDIA H200", "h100"),
    ("gpu", "NVIDIA H800", "h100"),
    ("gpu", "NVIDIA GH200 480GB", "h100"),
    ("gpu", "NVIDIA A100-SXM4-80GB", "a100"),
    ("gpu", "NVIDIA L4", "a100"),  # Other NVIDIA GPUs: the nearest matrix.
    ("tpu", "TPU v5 lite", "tpu_v5"),
    ("tpu", "TPU v6 lite", "tpu_v5"),
    ("cpu", "cpu", "cpu"),
  ],
)
def test_family_of(platform, kind, family):
  assert hardware.family_of(platform, kind) == family


@pytest.mark.parametrize(
  ("path", "family"),
  [
    ("tokamax._src.ops.attention.xla:XlaAttention", hardware.XLA),
    ("tokamax._src.ops.attention.xla_chunked:XlaChunkedAttention", hardware.XLA),
    ("tokamax._src.ops.linear_softmax_cross_entropy_loss.chunked_xla:ChunkedXlaLoss", hardware.XLA),
    ("tokamax._src.ops.attention.cudnn:CudnnAttention", hardware.CUDNN),
    ("tokamax._src.ops.attention.triton:TritonAttention", hardware.TRITON),
    ("tokamax._src.ops.attention.mosaic:MosaicAttention", hardware.MOSAIC_GPU),
    ("tokamax._src.ops.attention.mosaic_tpu:MosaicTpuAttention", hardware.MOSAIC_TPU),
    ("some.package.pallas_tpu:Kernel", hardware.MOSAIC_TPU),
  ],
)
def test_implementation_family(path, family):
  assert hardware.implementation_family(path) == family


@dataclasses.dataclass
class _FakeDevice:
  platform: str
  device_kind: str
  compute_capability: str | None = None

  def memory_stats(self):
    return {"bytes_limit": 80 << 30}


@pytest.fixture
def fake_device(monkeypatch):
  """`detect()` of a fake device: call with the device; the cache is cleared around it."""
  monkeypatch.delenv("TOKAMAX_FAMILY", raising=False)

  def detect(device, count=1):
    monkeypatch.setattr(jax, "devices", lambda *a: [device])
    monkeypatch.setattr(jax, "local_device_count", lambda *a: count)
    hardware.detect.cache_clear()
    return hardware.detect()

  yield detect
  hardware.detect.cache_clear()  # The next caller sees the real device again.


_GPU_FAMILIES = {hardware.XLA, hardware.CUDNN}


@pytest.mark.parametrize(
  ("kind", "cc", "runnable"),
  [
    ("NVIDIA H100 80GB HBM3", "9.0", _GPU_FAMILIES | {hardware.TRITON, hardware.MOSAIC_GPU}),
    ("NVIDIA A100-SXM4-80GB", "8.0", _GPU_FAMILIES | {hardware.TRITON}),
    ("Tesla T4", "7.5", _GPU_FAMILIES),
  ],
)
def test_detect_gpu(fake_device, kind, cc, runnable):
  profile = fake_device(_FakeDevice("gpu", kind, cc), count=2)
  assert profile.runnable == frozenset(runnable)
  assert profile.compute_capability == tuple(int(p) for p in cc.split("."))
  assert profile.has_f64 and profile.device_count == 2 and profile.memory_bytes == 80 << 30
  assert profile.reason_cannot_run(hardware.MOSAIC_TPU).startswith("Mosaic TPU needs a TPU")
  assert profile.reason_cannot_run(hardware.XLA) is None
  assert f"(gpu sm_{cc.replace('.', '')}, family" in profile.describe()


def test_detect_tpu(fake_device):
  profile = fake_device(_FakeDevice("tpu", "TPU v5 lite"))
  assert profile.family == "tpu_v5" and profile.compute_capability is None
  assert profile.runnable == frozenset({hardware.XLA, hardware.MOSAIC_TPU})
  assert not profile.has_f64  # TPUs have no float64 arithmetic.
  assert "Triton needs an NVIDIA GPU" in profile.reason_cannot_run(hardware.TRITON)


def test_family_override(fake_device, monkeypatch):
  monkeypatch.setenv("TOKAMAX_FAMILY", "a100")
  assert fake_device(_FakeDevice("gpu", "NVIDIA H200", "9.0")).family == "a100"
  monkeypatch.setenv("TOKAMAX_FAMILY", "v100")
  with pytest.raises(ValueError, match="TOKAMAX_FAMILY"):
    fake_device(_FakeDevice("gpu", "NVIDIA H200", "9.0"))


def _profile(platform="gpu", cc=None, count=1, runnable=()):
  return hardware.Profile(
    platform=platform,
    device_kind="fake",
    family="cpu",
    compute_capability=cc,
    memory_bytes=None,
    device_count=count,
    has_f64=platform != "tpu",
    runnable=frozenset(runnable),
  )


@pytest.mark.parametrize(
  ("cc", "missing"),
  [
    ((9, 0), []),
    ((8, 9), ["sm90"]),
    ((8, 0), ["sm90"]),
    ((7, 5), ["sm80", "sm90"]),
    (None, ["nvidia", "sm80", "sm90"]),
  ],
)
def test_requires_compute_capability(cc, missing):
  assert plugin.missing_features(("nvidia", "sm80", "sm90"), _profile(cc=cc)) == missing


def test_requires_other_features():
  cpu = _profile("cpu", runnable={hardware.XLA, hardware.INTERPRET})
  assert plugin.missing_features(("cpu", "f64", "interpret"), cpu) == []
  assert plugin.missing_features(("gpu", "tpu", "multi_device", "triton"), cpu) == [
    "gpu",
    "tpu",
    "multi_device",
    "triton",
  ]
  assert plugin.missing_features(("multi_device",), _profile("cpu", count=2)) == []
  assert plugin.missing_features(("f64",), _profile("tpu")) == ["f64"]
  with pytest.raises(ValueError, match="unknown features"):
    plugin.missing_features(("sm100",), cpu)


class _Item:
  """A stand-in test item: its markers, options and ini values."""

  def __init__(self, *marks, options=None, ini=None):
    self.marks = [m.mark for m in marks]
    self.config = types.SimpleNamespace(
      getoption=lambda name: (options or {}).get(name, False),
      getini=lambda name: (ini or {}).get(name, ""),
    )

  def iter_markers(self, name):
    return (m for m in self.marks if m.name == name)

  def get_closest_marker(self, name):
    return next(self.iter_markers(name), None)


def _skip_reason(item) -> str | None:
  try:
    plugin.pytest_runtest_setup(item)
  except pytest.skip.Exception as e:
    return str(e)
  return None


def test_long_tests_run_only_when_asked(monkeypatch):
  monkeypatch.delenv("TOKAMAX_NIGHTLY", raising=False)
  assert "--run-long" in _skip_reason(_Item(pytest.mark.long))
  assert _skip_reason(_Item(pytest.mark.long, options={"--run-long": True})) is None
  monkeypatch.setenv("TOKAMAX_NIGHTLY", "1")
  assert _skip_reason(_Item(pytest.mark.long)) is None
  monkeypatch.setenv("TOKAMAX_NIGHTLY", "0")
  assert _skip_reason(_Item(pytest.mark.long)) is not None


def test_bench_tests_run_only_with_bench():
  hint = {"harness_bench_hint": "nox -s bench"}
  assert (
    _skip_reason(_Item(pytest.mark.bench, ini=hint)) == "benchmark; run with --bench (nox -s bench)"
  )
  assert _skip_reason(_Item(pytest.mark.bench, options={"--bench": True})) is None


def test_requires_and_platform_markers_skip_with_the_reason():
  profile = hardware.detect()
  other = "tpu" if profile.platform != "tpu" else "gpu"
  assert _skip_reason(_Item(pytest.mark.requires(profile.platform))) is None
  reason = _skip_reason(_Item(pytest.mark.requires(profile.platform, other)))
  assert reason == f"requires {other}; this is {profile.describe()}"
  assert _skip_reason(_Item(getattr(pytest.mark, other))) is not None
  assert _skip_reason(_Item()) is None


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
def test_platform_markers_run_on_their_platform_only(fake_device, platform):
  fake_device(_FakeDevice(platform, "fake", "9.0" if platform == "gpu" else None))
  for marker in ("gpu", "tpu"):
    reason = _skip_reason(_Item(getattr(pytest.mark, marker)))
    assert (reason is None) == (marker == platform), (marker, reason)


@pytest.mark.parametrize(
  ("platform", "choice", "expected"),
  [
    ("cpu", "auto", True),
    ("gpu", "auto", False),
    ("tpu", "auto", False),
    ("gpu", "on", True),
    ("cpu", "off", False),
  ],
)
def test_interpret_fixture(fake_device, platform, choice, expected):
  fake_device(_FakeDevice(platform, "fake", "9.0" if platform == "gpu" else None))
  request = types.SimpleNamespace(config=types.SimpleNamespace(getoption=lambda name: choice))
  assert plugin.interpret.__wrapped__(request) is expected


def test_rng_key_differs_between_parametrized_cases():
  def key(nodeid):
    node = types.SimpleNamespace(nodeid=nodeid, name=nodeid.split("::")[-1], originalname="test_f")
    return jax.random.key_data(plugin.rng_key.__wrapped__(types.SimpleNamespace(node=node)))

  a, b = key("t.py::test_f[a]"), key("t.py::test_f[b]")
  assert (a != b).any()
  assert (a == key("t.py::test_f[a]")).all()


def test_hypothesis_profile_from_the_environment_beats_the_ini_option(monkeypatch):
  """No --hypothesis-profile: TOKAMAX_HYPOTHESIS_PROFILE wins over the ini option's profile."""
  import hypothesis

  config = types.SimpleNamespace(
    getoption=lambda name, default=None: None, getini=lambda name: "harness-dev"
  )
  before = hypothesis.settings.get_current_profile_name()
  try:
    monkeypatch.setenv("TOKAMAX_HYPOTHESIS_PROFILE", "harness-nightly")
    plugin._load_hypothesis_profile(config)
    assert hypothesis.settings.get_current_profile_name() == "harness-nightly"
    assert hypothesis.settings.default.max_examples == 200
    monkeypatch.delenv("TOKAMAX_HYPOTHESIS_PROFILE")
    plugin._load_hypothesis_profile(config)
    assert hypothesis.settings.get_current_profile_name() == "harness-dev"
  finally:
    hypothesis.settings.load_profile(before)


class _NoMemoryStats(_FakeDevice):
  def memory_stats(self):
    raise RuntimeError("memory_stats is not supported on this backend")


def test_detect_survives_a_backend_without_memory_stats(fake_device):
  profile = fake_device(_NoMemoryStats("tpu", "TPU v5 lite"))
  assert profile.memory_bytes is None and profile.platform == "tpu"


def test_no_compute_capability_off_nvidia_gpus(fake_device):
  """A device that is not a GPU has no CUDA compute capability, whatever attribute it carries."""
  profile = fake_device(_FakeDevice("tpu", "TPU v5 lite", "9.0"))
  assert profile.compute_capability is None
  assert hardware.CUDNN not in profile.runnable and hardware.MOSAIC_GPU not in profile.runnable


def test_a_gpu_without_a_compute_capability_runs_no_nvidia_kernels(fake_device):
  """A GPU that reports no CUDA compute capability (ROCm) can run neither cuDNN nor Triton nor
  Mosaic GPU: only XLA, and the nearest matrix (a100)."""
  profile = fake_device(_FakeDevice("gpu", "AMD Instinct MI300X"))
  assert profile.compute_capability is None
  assert profile.runnable == frozenset({hardware.XLA})
  assert profile.family == "a100"
  assert "cuDNN needs an NVIDIA GPU" in profile.reason_cannot_run(hardware.CUDNN)


def test_compilation_cache_keeps_a_triton_cache_dir_already_set(monkeypatch, tmp_path):
  """TOKAMAX_COMPILATION_CACHE=DIR: jax's cache in DIR/jax; Triton's in DIR/triton unless
  TRITON_CACHE_DIR is set already. (jax's config is recorded here, not changed.)"""
  updates = {}
  monkeypatch.setattr(
    plugin.jax.config, "update", lambda name, value: updates.update({name: value})
  )
  monkeypatch.setenv("TOKAMAX_COMPILATION_CACHE", str(tmp_path))
  monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere/triton")
  plugin._enable_compilation_caches()
  assert os.environ["TRITON_CACHE_DIR"] == "/elsewhere/triton"
  assert updates["jax_compilation_cache_dir"] == str(tmp_path / "jax")
  monkeypatch.delenv("TRITON_CACHE_DIR")
  plugin._enable_compilation_caches()
  assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")


def test_every_requires_marker_counts():
  """A class-level and a test-level `requires`: the test runs only with both satisfied."""
  profile = hardware.detect()
  other = "tpu" if profile.platform != "tpu" else "gpu"
  item = _Item(pytest.mark.requires(profile.platform), pytest.mark.requires(other))
  assert _skip_reason(item) == f"requires {other}; this is {profile.describe()}"
