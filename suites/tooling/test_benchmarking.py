"""standardize_function and benchmark on CPU (issue 7)."""

import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax
from tokamax._src import benchmarking


def matmul(x, w, *, scale):
  # HIGHEST: float32 matmuls default to TF32 on GPUs, and the checks are against float64.
  return scale * jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST)


def inputs(seed=0):
  kx, kw = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (8, 16)), jax.random.normal(kw, (16, 4))


def test_forward_passes_static_leaves_through():
  x, w = inputs()
  fn, arrays = tokamax.standardize_function(matmul, x, w, kwargs={"scale": 2.0})
  assert len(arrays) == 2
  np.testing.assert_allclose(
    np.asarray(fn(arrays)),
    2.0 * np.asarray(x, np.float64) @ np.asarray(w, np.float64),
    rtol=1e-5,
    atol=1e-5,
  )


def test_forward_and_vjp_against_the_analytic_gradient():
  x, w = inputs()
  fn, arrays = tokamax.standardize_function(
    matmul, x, w, kwargs={"scale": 1.0}, mode="forward_and_vjp"
  )
  out, ((dx, dw),) = jax.jit(fn)(arrays)
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  y = x64 @ w64  # The output is its own cotangent.
  np.testing.assert_allclose(np.asarray(out), y, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dx), y @ w64.T, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dw), x64.T @ y, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", [0, None], ids=["seeded", "concrete_arrays_no_seed"])
def test_vjp_mode_takes_random_cotangents(seed):
  """The cotangents are random, also with seed=None (allowed for concrete arrays)."""
  x, w = inputs()
  fn, douts = tokamax.standardize_function(
    matmul, x, w, kwargs={"scale": 1.0}, mode="vjp", seed=seed
  )
  ((dx, dw),) = jax.jit(fn)(douts)
  (g,) = douts
  assert g.shape == (8, 4) and float(jnp.std(g)) > 0.5
  g64, x64, w64 = (np.asarray(a, np.float64) for a in (g, x, w))
  np.testing.assert_allclose(np.asarray(dx), g64 @ w64.T, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dw), x64.T @ g64, rtol=1e-4, atol=1e-5)


def test_shape_dtype_structs_of_one_shape_get_different_values():
  """q, k and v given as one ShapeDtypeStruct each are three different random arrays."""
  spec = jax.ShapeDtypeStruct((16, 8), jnp.float32)
  _, (q, k, v) = tokamax.standardize_function(lambda q, k, v: q, spec, spec, spec)
  for a, b in ((q, k), (q, v), (k, v)):
    assert not np.array_equal(np.asarray(a), np.asarray(b))


def test_forward_res_returns_the_residuals():
  x = inputs()[0]
  fn, arrays = tokamax.standardize_function(jnp.tanh, x, mode="forward_res")
  out, residuals = jax.jit(fn)(arrays)
  np.testing.assert_allclose(np.asarray(out), np.tanh(np.asarray(x, np.float64)), rtol=1e-5)
  assert residuals  # tanh's derivative needs its output.


def test_shape_dtype_structs_become_seeded_random_arrays():
  spec = (jax.ShapeDtypeStruct((64, 32), jnp.bfloat16), jax.ShapeDtypeStruct((32,), jnp.int32))
  _, a = tokamax.standardize_function(lambda x, i: x, *spec, seed=1)
  _, b = tokamax.standardize_function(lambda x, i: x, *spec, seed=1)
  _, c = tokamax.standardize_function(lambda x, i: x, *spec, seed=2)
  assert a[0].dtype == jnp.bfloat16 and a[0].shape == (64, 32)
  np.testing.assert_array_equal(np.asarray(a[0], np.float32), np.asarray(b[0], np.float32))
  assert not np.array_equal(np.asarray(a[0], np.float32), np.asarray(c[0], np.float32))
  assert 0.8 < float(jnp.std(a[0].astype(jnp.float32))) < 1.2
  np.testing.assert_array_equal(np.asarray(a[1]), 0)  # Integers are valid indices.
  with pytest.raises(ValueError, match="seed=None"):
    tokamax.standardize_function(lambda x, i: x, *spec, seed=None)
  with pytest.raises(ValueError, match="mode"):
    tokamax.standardize_function(jnp.tanh, inputs()[0], mode="backward")


def _sleep_ms(ms):
  def host(x):
    time.sleep(ms / 1e3)
    return x

  return lambda x: jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def test_benchmark_times_the_compiled_function():
  x = jnp.ones((4,), jnp.float32)
  # A host sleep has no device time: the wallclock method, on every platform.
  data = tokamax.benchmark(_sleep_ms(20), x, iterations=4, method="wallclock")
  assert isinstance(data, tokamax.BenchmarkData)
  assert len(data.evaluation_times_ms) == 4
  assert data.median_evaluation_time_ms == float(np.median(data.evaluation_times_ms))
  assert 20 <= data.median_evaluation_time_ms < 200  # time.sleep is the independent clock.
  assert data.lower_time_ms > 0 and data.compile_time_ms > 0
  assert data.metadata["method"] == "wallclock" and data.metadata["iterations"] == 4
  assert data.asdict()["median_evaluation_time_ms"] == data.median_evaluation_time_ms


def test_timed_runs_include_the_computation_not_just_its_dispatch():
  """One timed run of ~50 ms of matmuls (JAX dispatches it asynchronously) takes about as
  long as the same compiled program timed here (the faster of two runs), waiting for its
  result."""
  a = jax.random.normal(jax.random.key(0), (1024, 1024), jnp.float32) / 32
  fn = lambda a: jnp.linalg.matrix_power(a, 8)
  compiled = jax.jit(fn).lower(a).compile()
  jax.block_until_ready(compiled(a))
  reference_ms = float("inf")
  for _ in range(2):
    start = time.perf_counter()
    jax.block_until_ready(compiled(a))
    reference_ms = min(reference_ms, (time.perf_counter() - start) * 1e3)
  data = tokamax.benchmark(fn, a, iterations=1, method="wallclock")
  assert data.evaluation_times_ms[0] > 0.4 * reference_ms, (data.evaluation_times_ms, reference_ms)


def test_benchmark_of_a_standardized_function_reports_memory():
  x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
  fn, arrays = tokamax.standardize_function(lambda a: a @ a, x)
  data = tokamax.benchmark(fn, arrays, iterations=3, method="wallclock")
  assert data.peak_memory_bytes is None or data.peak_memory_bytes >= 2 * 256 * 256 * 4
  assert all(t > 0 for t in data.evaluation_times_ms)


def test_benchmark_rejects_what_it_cannot_do():
  x = jnp.ones((4,), jnp.float32)
  if jax.default_backend() != "gpu":
    assert benchmarking.default_method() == "wallclock"
    with pytest.raises(ValueError, match=r"cupti.*NVIDIA GPU"):
      tokamax.benchmark(jnp.sin, x, method="cupti")
  # The methods `benchmark` documents: "wallclock", "cupti" or None.
  with pytest.raises(ValueError, match=r"one of \['cupti', 'wallclock'\] or None, got 'xprof'"):
    tokamax.benchmark(jnp.sin, x, method="xprof")
  with pytest.raises(ValueError, match="iterations"):
    tokamax.benchmark(jnp.sin, x, iterations=0)


def test_benchmark_of_one_iteration():
  data = tokamax.benchmark(jnp.sin, jnp.ones((4,), jnp.float32), iterations=1, method="wallclock")
  assert len(data.evaluation_times_ms) == 1
  assert data.median_evaluation_time_ms == data.evaluation_times_ms[0] > 0


def test_peak_memory_counts_temporaries():
  """The product a @ a (256 KiB) is a temporary: the scalar output cannot hold it."""
  x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
  fn, arrays = tokamax.standardize_function(lambda a: jnp.cumsum(a @ a, axis=0).sum(), x)
  data = tokamax.benchmark(fn, arrays, iterations=1, method="wallclock")
  if data.peak_memory_bytes is not None:  # Where XLA reports a memory analysis.
    assert data.peak_memory_bytes >= 256 * 256 * 4 + 256 * 256 * 4


def test_vjp_cotangents_are_not_the_inputs():
  """Cotangents are drawn apart from the inputs, also where their shapes agree."""
  x = jax.ShapeDtypeStruct((64,), jnp.float32)
  _, (inp,) = tokamax.standardize_function(jnp.sin, x, seed=0)
  fn, (dout,) = tokamax.standardize_function(jnp.sin, x, mode="vjp", seed=0)
  assert not np.array_equal(np.asarray(inp), np.asarray(dout))
  (dx,) = jax.jit(fn)([dout])
  # The residuals are those of the seeded input: d sin(x) = cos(x) * dout.
  np.testing.assert_allclose(
    np.asarray(dx[0]), np.cos(np.asarray(inp, np.float64)) * np.asarray(dout), rtol=1e-5, atol=1e-6
  )


def test_random_arrays_of_each_kind():
  """Floats normal, booleans all True (an all-False mask would time a fully masked call), ints 0."""
  key = jax.random.key(0)
  f = benchmarking.random_array(key, (4096,), jnp.bfloat16)
  assert f.dtype == jnp.bfloat16 and 0.9 < float(jnp.std(f.astype(jnp.float32))) < 1.1
  b = benchmarking.random_array(key, (3, 5), jnp.bool_)
  assert b.dtype == jnp.bool_ and b.shape == (3, 5) and bool(b.all())
  i = benchmarking.random_array(key, (7,), jnp.int32)
  assert i.dtype == jnp.int32 and not np.asarray(i).any()
  c = benchmarking.random_array(key, (4096,), jnp.complex64)
  assert c.dtype == jnp.complex64 and 0.9 < float(jnp.std(jnp.real(c))) < 1.1


def test_wallclock_timing_leaves_out_a_warm_up_run():
  """The first call (slow here, as a first call with one-time costs is) runs untimed."""
  calls = []

  def fn(x):
    calls.append(None)
    if len(calls) == 1:
      time.sleep(0.3)
    return x

  times = benchmarking.time_compiled(fn, jnp.ones(4), iterations=3, method="wallclock")
  assert len(calls) == 4 and len(times) == 3
  assert max(times) < 150, times


def test_lowering_and_compilation_times_are_told_apart():
  """A function slow to trace (0.6 s of host sleep) is slow to lower, not to compile."""

  def slow_to_trace(x):
    time.sleep(0.6)
    return jnp.sin(x)

  data = tokamax.benchmark(slow_to_trace, jnp.ones(4), iterations=1, method="wallclock")
  assert data.lower_time_ms >= 600
  assert data.compile_time_ms < data.lower_time_ms


def test_lowering_compilation_and_runs_are_timed_in_milliseconds(monkeypatch):
  """On a clock that ticks 0.25 s per reading, every timed span is 250 ms."""
  ticks = iter(0.25 * np.arange(100))
  clock = types.SimpleNamespace(perf_counter=lambda: float(next(ticks)))
  monkeypatch.setattr(benchmarking, "time", clock)
  data = tokamax.benchmark(jnp.sin, jnp.ones(4), iterations=2, method="wallclock")
  assert data.lower_time_ms == pytest.approx(250)
  assert data.compile_time_ms == pytest.approx(250)
  assert data.evaluation_times_ms == pytest.approx((250, 250))


def test_peak_memory_is_arguments_outputs_and_temporaries_less_aliased_buffers():
  """Read off XLA's memory analysis: 1000 + 300 + 50 - 200 bytes."""
  stats = types.SimpleNamespace(
    argument_size_in_bytes=1000,
    output_size_in_bytes=300,
    temp_size_in_bytes=50,
    alias_size_in_bytes=200,
  )
  compiled = types.SimpleNamespace(memory_analysis=lambda: stats)
  assert benchmarking._peak_memory_bytes(compiled) == 1150
  assert (
    benchmarking._peak_memory_bytes(types.SimpleNamespace(memory_analysis=lambda: None)) is None
  )


def test_benchmark_metadata_names_the_method_and_iterations_used(monkeypatch):
  """A timer registered for "cupti" (faked here) is the one run and the one reported."""
  runs = []

  def fake_cupti(fn, args, iterations):
    runs.append(iterations)
    return [0.5 * (i + 1) for i in range(iterations)]

  monkeypatch.setitem(benchmarking._TIMERS, "cupti", fake_cupti)
  data = tokamax.benchmark(jnp.sin, jnp.ones((4,)), iterations=3, method="cupti")
  assert runs == [3]
  assert data.evaluation_times_ms == (0.5, 1.0, 1.5)
  assert data.median_evaluation_time_ms == 1.0
  assert data.metadata["method"] == "cupti" and data.metadata["iterations"] == 3
  assert data.metadata["platform"] == jax.default_backend()


class _FakeCupti:
  """CUPTI's measure(): a float for one iteration, a list for several, None without kernels."""

  timings = None

  def __init__(self, finalize):
    assert finalize is False

  def measure(self, fn, iterations):
    def run(*args):
      return fn(*args), self.timings(iterations)

    return run


@pytest.mark.parametrize(
  ("iterations", "timings", "expected"),
  [
    (1, lambda n: 2.5, [2.5]),
    (3, lambda n: [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]),
    (3, lambda n: None, [0.0, 0.0, 0.0]),
  ],
  ids=["one_run_a_float", "runs_a_list", "no_kernel"],
)
def test_cupti_times_one_per_iteration(monkeypatch, iterations, timings, expected):
  monkeypatch.setattr(benchmarking, "cupti_unavailable_reason", lambda: None)
  monkeypatch.setattr(_FakeCupti, "timings", staticmethod(timings))
  monkeypatch.setattr(benchmarking, "_cupti_profiler", lambda: _FakeCupti)
  assert benchmarking.default_method() == "cupti"
  assert benchmarking.cupti_times(jnp.sin, (jnp.ones(4),), iterations) == expected


def test_cupti_unavailable_reasons_say_what_is_missing(monkeypatch):
  """Off an NVIDIA GPU the reason is the GPU; on one, a profiler that did not load."""
  monkeypatch.setattr(benchmarking.device, "is_nvidia_gpu", lambda: False)
  assert "needs an NVIDIA GPU" in benchmarking.cupti_unavailable_reason()
  monkeypatch.setattr(benchmarking.device, "is_nvidia_gpu", lambda: True)
  monkeypatch.setattr(benchmarking, "_cupti_profiler", lambda: None)
  assert "did not load" in benchmarking.cupti_unavailable_reason()
  with pytest.raises(ValueError, match=r"method='cupti' is unavailable: .*did not load"):
    benchmarking.cupti_times(jnp.sin, (jnp.ones(4),), 1)
  monkeypatch.setattr(benchmarking, "_cupti_profiler", lambda: _FakeCupti)
  assert benchmarking.cupti_unavailable_reason() is None


def test_numpy_arrays_are_inputs_not_constants():
  """A NumPy argument is one of the arrays handed to `fn`, like a JAX array."""
  fn, arrays = tokamax.standardize_function(jnp.sin, np.full((4,), 0.5, np.float32))
  assert len(arrays) == 1
  np.testing.assert_allclose(np.asarray(arrays[0]), 0.5)
  np.testing.assert_allclose(np.asarray(fn([np.zeros(4, np.float32)])), np.zeros(4))
