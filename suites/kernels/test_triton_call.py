"""The launch wrapper: batching (under `jax.vmap` a launch runs once per batch element),
Triton types, grids, the interpreter's unwritten outputs and compiling for a target."""

import os
import re
import sys
import tempfile
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl

from tokamax._src import triton_call


def test_vmap_runs_the_launch_per_element_and_passes_unbatched_arguments_whole():
  seen_shapes = []

  def launch(x, w):  # Stands in for a kernel launch that has no batching rule.
    seen_shapes.append((x.shape, w.shape))
    return [x @ w, jnp.sum(x, axis=-1)]

  f = triton_call.sequential_under_vmap(launch)
  rng = np.random.default_rng(0)
  xs = jnp.asarray(rng.standard_normal((3, 4, 5)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((5, 6)), jnp.float32)
  got = jax.jit(jax.vmap(f, in_axes=(0, None)))(xs, w)
  for i in range(3):
    np.testing.assert_allclose(got[0][i], np.asarray(xs[i]) @ np.asarray(w), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1][i], np.asarray(xs[i]).sum(-1), rtol=1e-5, atol=1e-5)
  assert seen_shapes and all(s == ((4, 5), (5, 6)) for s in seen_shapes), seen_shapes
  # Batched on the second axis, and nested vmaps.
  got = jax.vmap(jax.vmap(f, in_axes=(1, None)), in_axes=(0, None))(xs[:, :, None], w)
  np.testing.assert_allclose(got[0][:, 0], np.asarray(xs) @ np.asarray(w), rtol=1e-5, atol=1e-5)


# -- Types, grids and compiling (CPU) ----------------------------------------------


@triton.jit
def _first_half_doubled(x_ptr, y_ptr, i_ptr, N: tl.constexpr):
  """Writes only the first half of its outputs: y = 2x and i = the index there."""
  offs = tl.arange(0, N)
  half = offs < N // 2
  tl.store(y_ptr + offs, tl.load(x_ptr + offs) * 2.0, mask=half)
  tl.store(i_ptr + offs, offs, mask=half)


@triton.jit
def _scaled_copy(x_ptr, n, scale, y_ptr, BLOCK: tl.constexpr):
  offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
  tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * scale, mask=offs < n)


@pytest.mark.parametrize(
  "name",
  [
    "bfloat16",
    "float64",
    "float32",
    "float16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint32",
    "uint8",
    "bool",
  ],
)
def test_array_types_parse_to_the_triton_dtype_of_the_same_name(name):
  """Triton's own parser of signature strings reads each array's type back as the
  `triton.language` dtype named like the array's (bool: int1)."""
  tl_name = "int1" if name == "bool" else name
  parsed = tl.str_to_ty(triton_call._type_of(np.zeros(2, name)), None)
  assert parsed == tl.pointer_type(getattr(tl, tl_name)), parsed


def test_scalar_types():
  """Integers as Triton's launcher specialises them (i32 in the signed 32-bit range, else
  i64); bools as i1; Python floats as fp64, as jax-triton."""
  from triton.runtime.jit import mangle_type

  for value in (-(2**31) - 1, -(2**31), 0, 5, 2**31 - 1, 2**40):
    assert triton_call._type_of(value) == mangle_type(value), value
  assert triton_call._type_of(2**31) != "i32"
  assert triton_call._type_of(True) == triton_call._type_of(False) == "i1"
  assert triton_call._type_of(1.5) == "fp64"
  with pytest.raises(TypeError):
    triton_call._type_of("a")


def test_grids_of_numpy_ints_and_of_functions_of_the_meta_parameters():
  x = jnp.zeros(8, jnp.float32)
  shape = jax.ShapeDtypeStruct((8,), jnp.float32)
  with triton_call.capture() as launches:
    triton_call.call(_scaled_copy, x, 8, 1.0, out_shape=shape, grid=np.int64(3), BLOCK=4)
    triton_call.call(
      _scaled_copy, x, 8, 1.0, out_shape=shape, grid=lambda meta: (8 // meta["BLOCK"], 1), BLOCK=4
    )
  assert [launch.grid for launch in launches] == [(3,), (2, 1)]


@pytest.mark.host_only
def test_interpreted_outputs_not_written_read_nan_or_minus_one():
  """The interpreter fills outputs with NaN (integers: -1) first, so a kernel that leaves
  elements unwritten cannot pass for one that wrote zeros; eager and under jit."""
  x = jnp.asarray(np.random.default_rng(0).standard_normal(8), jnp.float32)
  shapes = [jax.ShapeDtypeStruct((8,), jnp.float32), jax.ShapeDtypeStruct((8,), jnp.int32)]

  def run(x):
    return triton_call.call(_first_half_doubled, x, out_shape=shapes, grid=(1,), N=8)

  with triton_call.interpret():
    outs = [run(x), jax.jit(run)(x)]
  for y, i in outs:
    np.testing.assert_array_equal(np.asarray(y)[:4], 2 * np.asarray(x)[:4])
    assert np.isnan(np.asarray(y)[4:]).all(), y
    np.testing.assert_array_equal(np.asarray(i), [0, 1, 2, 3, -1, -1, -1, -1])


@triton.jit
def _ones_at(y_ptr, START: tl.constexpr, N: tl.constexpr):
  """Stores 1.0 to elements START .. START + N - 1 of y, unmasked (past its ends if asked)."""
  offs = START + tl.arange(0, N)
  tl.store(y_ptr + offs, tl.full([N], 1.0, tl.float32))


@pytest.mark.host_only
@pytest.mark.parametrize("start", [-4, 0, 4], ids=["before", "inside", "after"])
def test_interpreted_stores_outside_an_output_raise(start):
  """Each interpreted output lies between guard bytes: a kernel that stores before or past
  an output's ends (which on a GPU corrupts whatever memory lies there) raises, naming
  the kernel and the output; one that stays inside runs."""
  y_shape = jax.ShapeDtypeStruct((8,), jnp.float32)
  with triton_call.interpret():
    if start == 0:
      (y,) = triton_call.call(_ones_at, out_shape=[y_shape], grid=(1,), START=start, N=8)
      np.testing.assert_array_equal(np.asarray(y), np.ones(8))
    else:
      with pytest.raises(RuntimeError, match=r"_ones_at wrote outside its output 0 \(8,\)"):
        triton_call.call(_ones_at, out_shape=[y_shape], grid=(1,), START=start, N=8)


@pytest.mark.host_only
def test_interpreted_output_margins_are_as_large_as_the_output():
  """Each guard margin is at least 4 KiB and as large as the output (`_guarded`'s rule, up
  to rounding to 64 bytes), no larger: a store that lands 6 KiB past the end of an 8 KiB
  output, inside its margin, raises (a fixed 4 KiB margin would let it write past the whole
  buffer, into other memory), and an output costs about three times its size, not more."""
  for shape, nbytes in (((8,), 32), ((2048,), 8192), ((3, 1000), 12000)):
    output, raw, margin = triton_call._guarded(shape, np.float32)
    assert max(4096, nbytes) <= margin < max(4096, nbytes) + 64, (shape, margin)
    assert raw.nbytes == nbytes + 2 * margin and output.shape == shape
    assert output.ctypes.data == raw.ctypes.data + margin
  y_shape = jax.ShapeDtypeStruct((2048,), jnp.float32)
  message = r"_ones_at wrote outside its output 0 \(2048,\)"
  with triton_call.interpret(), pytest.raises(RuntimeError, match=message):
    triton_call.call(_ones_at, out_shape=[y_shape], grid=(1,), START=2048 + 1536, N=16)


@triton.jit
def _copy_from(x_ptr, y_ptr, START: tl.constexpr, N: tl.constexpr):
  """y = x[START : START + N], loaded unmasked (past x's ends if asked)."""
  offs = tl.arange(0, N)
  tl.store(y_ptr + offs, tl.load(x_ptr + START + offs))


@pytest.mark.host_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_interpreted_loads_past_a_float_input_read_nan(dtype):
  """Each interpreted float input lies between NaNs: an unmasked load past either end
  reads NaN (a neighbouring buffer's finite numbers would pass unseen where a select or a
  product with zero drops them; on a GPU such a load may read anything, or fault)."""
  x = jnp.arange(1, 9, dtype=dtype)
  y_shape = jax.ShapeDtypeStruct((8,), dtype)
  with triton_call.interpret():
    (after,) = triton_call.call(_copy_from, x, out_shape=[y_shape], grid=(1,), START=4, N=8)
    (before,) = triton_call.call(_copy_from, x, out_shape=[y_shape], grid=(1,), START=-4, N=8)
  after, before = np.asarray(after, np.float32), np.asarray(before, np.float32)
  np.testing.assert_array_equal(after[:4], [5, 6, 7, 8])
  assert np.isnan(after[4:]).all(), after
  assert np.isnan(before[:4]).all(), before
  np.testing.assert_array_equal(before[4:], [1, 2, 3, 4])


def _signature(compiled) -> dict[str, str]:
  """Runtime argument name -> its TTIR type and attributes, from the compiled kernel."""
  ttir = compiled.asm["ttir"]
  params = re.search(r"tt\.func public @\w+\((.*?)\) attributes", ttir, re.S).group(1)
  params = re.sub(r"loc\((?:[^()]|\([^()]*\))*\)", "", params)
  return dict(re.findall(r"%(\w+): ([^,]*?)\s*(?:,|$)", params))


def test_compile_launch_follows_the_launch():
  """As jax-triton: pointers 16-byte aligned, scalars not; a scalar equal to 1 is a
  constant; the launch's warps and stages."""
  x = jnp.zeros(64, jnp.bfloat16)
  shape = jax.ShapeDtypeStruct((64,), jnp.bfloat16)
  with triton_call.capture() as launches:
    for n in (64, 1):
      triton_call.call(
        _scaled_copy, x, n, 2.0, out_shape=shape, grid=(1,), BLOCK=64, num_warps=2, num_stages=2
      )
  general, one = (triton_call.compile_launch(launch, 80) for launch in launches)
  sig = _signature(general)
  assert set(sig) == {"x_ptr", "n", "scale", "y_ptr"}, sig
  for name in ("x_ptr", "y_ptr"):
    assert sig[name].startswith("!tt.ptr<bf16>") and "tt.divisibility = 16" in sig[name], sig
  assert sig["n"] == "i32" and sig["scale"] == "f64", sig
  assert set(_signature(one)) == {"x_ptr", "scale", "y_ptr"}
  assert (general.metadata.num_warps, general.metadata.num_stages) == (2, 2)


def test_compile_for_leaves_the_cache_dir_variable_as_it_was(monkeypatch):
  """Unset stays unset; a value stays (the value-"" case: test_triton_layer_norm.py)."""
  signature = {"x_ptr": "*fp32", "n": "i32", "scale": "fp32", "y_ptr": "*fp32"}
  monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
  assert "cubin" in triton_call.compile_for(_scaled_copy, signature, {"BLOCK": 32}, 80).asm
  assert "TRITON_CACHE_DIR" not in os.environ
  path = os.path.join(tempfile.gettempdir(), "tokamax_triton_cache")
  monkeypatch.setenv("TRITON_CACHE_DIR", path)
  triton_call.compile_for(_scaled_copy, signature, {"BLOCK": 32}, 80)
  assert os.environ["TRITON_CACHE_DIR"] == path


def test_unavailable_reason_needs_sm80(monkeypatch):
  monkeypatch.setattr(triton_call, "_import_error", lambda: None)
  for cc, words in (("7.5", "sm_80 or newer, not sm_75"), ("8.0", None), ("9.0", None)):
    monkeypatch.setattr(
      jax, "devices", lambda cc=cc: [types.SimpleNamespace(compute_capability=cc)]
    )
    reason = triton_call.unavailable_reason("gpu")
    assert reason is None if words is None else words in reason, (cc, reason)
  monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace()])
  assert "compute capability" in triton_call.unavailable_reason("gpu")
  assert "not on cpu" in triton_call.unavailable_reason("cpu")


def test_numpy_scalars_are_scalars_typed_as_jax_triton_types_them():
  """Not 0-d arrays (pointers): a numpy float32 is fp32 (jax-triton passes it so), others as
  the Python scalar of their value; the interpreter and a compiled launch take them too."""
  assert triton_call._type_of(np.float32(1.5)) == "fp32"
  assert triton_call._type_of(np.float64(1.5)) == "fp64"
  assert triton_call._type_of(np.int32(7)) == "i32"
  assert triton_call._type_of(np.int64(2**40)) == "i64"
  assert triton_call._type_of(np.bool_(True)) == "i1"
  x = jnp.arange(8, dtype=jnp.float32)
  shape = jax.ShapeDtypeStruct((8,), jnp.float32)
  for n, scale in ((np.int32(6), np.float32(2.0)), (np.int64(6), np.float64(2.0))):
    with triton_call.interpret():
      y = triton_call.call(_scaled_copy, x, n, scale, out_shape=shape, grid=(1,), BLOCK=8)
    np.testing.assert_array_equal(np.asarray(y)[:6], 2 * np.arange(6, dtype=np.float32))
    with triton_call.capture() as launches:
      triton_call.call(_scaled_copy, x, n, scale, out_shape=shape, grid=(1,), BLOCK=8)
    sig = _signature(triton_call.compile_launch(launches[0], 80))
    assert sig["n"] == "i32" and sig["scale"] == ("f32" if scale.dtype == np.float32 else "f64")


_SCALED_COPY_SIGNATURE = {"x_ptr": "*fp32", "n": "i32", "scale": "fp32", "y_ptr": "*fp32"}


@pytest.mark.parametrize("sm", (80, 90))
def test_compile_for_targets_the_compute_capability_warps_and_stages_asked_for(sm):
  compiled = triton_call.compile_for(
    _scaled_copy, _SCALED_COPY_SIGNATURE, {"BLOCK": 32}, sm, num_warps=8, num_stages=2
  )
  assert compiled.metadata.target.arch == sm
  assert (compiled.metadata.num_warps, compiled.metadata.num_stages) == (8, 2)
  assert re.search(rf"^\.target sm_{sm}a?\b", compiled.asm["ptx"], re.M), sm


def test_compile_for_and_compile_launch_target_sm90_by_default():
  """The documented default target: sm_90 (H100/H200)."""
  x = jnp.zeros(32, jnp.float32)
  shape = jax.ShapeDtypeStruct((32,), jnp.float32)
  with triton_call.capture() as launches:
    triton_call.call(_scaled_copy, x, 32, np.float32(2.0), out_shape=shape, grid=(1,), BLOCK=32)
  for compiled in (
    triton_call.compile_for(_scaled_copy, _SCALED_COPY_SIGNATURE, {"BLOCK": 32}),
    triton_call.compile_launch(launches[0]),
  ):
    assert compiled.metadata.target.arch == 90
    assert re.search(r"^\.target sm_90a?\b", compiled.asm["ptx"], re.M)


def test_compile_for_alignment_hints_only_where_asked():
  """`aligned=()` marks no pointer aligned; a list marks exactly the arguments it names."""
  for aligned, expected in (((), set()), (["x_ptr"], {"x_ptr"}), (None, {"x_ptr", "y_ptr"})):
    compiled = triton_call.compile_for(
      _scaled_copy, _SCALED_COPY_SIGNATURE, {"BLOCK": 32}, 80, aligned=aligned
    )
    sig = _signature(compiled)
    hinted = {name for name, attrs in sig.items() if "tt.divisibility = 16" in attrs}
    assert hinted == expected, (aligned, sig)


def test_compile_for_names_the_arguments_given_no_type_or_value():
  signature = {"x_ptr": "*fp32", "n": "i32", "y_ptr": "*fp32"}
  with pytest.raises(ValueError, match=r"_scaled_copy: no type or value for arguments \['scale'\]"):
    triton_call.compile_for(_scaled_copy, signature, {"BLOCK": 32}, 80)


def test_unavailable_reason_reports_a_missing_jax_triton(monkeypatch):
  monkeypatch.setattr(triton_call, "_import_error", lambda: "jax-triton cannot be imported (x)")
  monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace(compute_capability="9.0")])
  assert triton_call.unavailable_reason("gpu") == "jax-triton cannot be imported (x)"


# -- The interpreter (CPU) -----------------------------------------------------------


@triton.jit
def _times_three(v):
  return v * 3.0


@triton.jit
def _tripled(x_ptr, y_ptr, N: tl.constexpr):
  offs = tl.arange(0, N)
  tl.store(y_ptr + offs, _times_three(tl.load(x_ptr + offs)))


@pytest.mark.host_only
def test_interpreted_launch_ignores_launch_options_and_reads_numpy_in_logical_order():
  """Launch options are not kernel arguments; a Fortran-ordered numpy input is read as
  its values in row-major order, as a jax array of them would be."""
  x = np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4))
  shape = jax.ShapeDtypeStruct((3, 4), jnp.float32)
  with triton_call.interpret():
    y = triton_call.call(
      _scaled_copy, x, 12, 2.0, out_shape=shape, grid=(1,), BLOCK=16, num_warps=2, num_stages=2
    )
  np.testing.assert_array_equal(np.asarray(y), 2 * np.arange(12, dtype=np.float32).reshape(3, 4))


@pytest.mark.host_only
def test_interpreted_launch_leaves_the_kernel_module_and_triton_as_they_were():
  """The jitted helpers it interprets are jitted again after, Triton's tensor patch is
  its own again, and the kernel still compiles."""
  from triton.runtime import interpreter

  patch_before = interpreter._patch_lang_tensor
  x = jnp.arange(8, dtype=jnp.float32)
  with triton_call.interpret():
    y = triton_call.call(
      _tripled, x, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), grid=1, N=8
    )
  np.testing.assert_array_equal(np.asarray(y), 3 * np.arange(8, dtype=np.float32))
  assert isinstance(globals()["_times_three"], triton.runtime.JITFunction)
  assert interpreter._patch_lang_tensor is patch_before
  signature = {"x_ptr": "*fp32", "y_ptr": "*fp32"}
  assert "cubin" in triton_call.compile_for(_tripled, signature, {"N": 8}, 80).asm


def test_host_tensors_of_one_dtype_share_one_dtype_object():
  """Triton's interpreter caches types by object: one lasting object per dtype."""
  a = triton_call._HostTensor(np.zeros(2, np.float32))
  b = triton_call._HostTensor(np.ones(3, np.float32))
  c = triton_call._HostTensor(np.ones(3, np.float16))
  assert a.dtype is b.dtype and str(a.dtype) == "torch.float32"
  assert c.dtype is not a.dtype and str(c.dtype) == "torch.float16"


@pytest.mark.host_only
def test_interpreted_launch_under_vmap_runs_per_element():
  xs = jnp.asarray(np.random.default_rng(1).standard_normal((3, 8)), jnp.float32)
  shape = jax.ShapeDtypeStruct((8,), jnp.float32)

  def run(x):
    return triton_call.call(_scaled_copy, x, 8, 2.0, out_shape=shape, grid=(1,), BLOCK=8)

  with triton_call.interpret():
    ys = jax.vmap(run)(xs)
  np.testing.assert_array_equal(np.asarray(ys), 2 * np.asarray(xs))


@pytest.mark.host_only
def test_an_error_inside_interpret_or_capture_ends_the_block():
  """After an exception inside either block, launches are neither interpreted nor recorded."""
  x = jnp.arange(8, dtype=jnp.float32)
  shape = jax.ShapeDtypeStruct((8,), jnp.float32)
  with pytest.raises(RuntimeError, match="inside"), triton_call.interpret():
    raise RuntimeError("inside")
  assert not triton_call.interpreting()
  with pytest.raises(RuntimeError, match="inside"), triton_call.capture():
    raise RuntimeError("inside")
  with triton_call.interpret():  # Run, not recorded with a random placeholder output.
    y = triton_call.call(_scaled_copy, x, 8, 2.0, out_shape=shape, grid=(1,), BLOCK=8)
  np.testing.assert_array_equal(np.asarray(y), 2 * np.arange(8, dtype=np.float32))


def test_launch_through_jax_triton_passes_everything_and_runs_per_element_under_vmap(
  monkeypatch,
):
  """A stand-in jax-triton (a host callback with no batching rule, as jax-triton's call)
  receives the arrays and scalars in order (a numpy integer as a Python int: jax-triton would
  take it for an array), the grid and every meta-parameter; under vmap it is called once per
  batch element."""
  seen = []

  def fake_triton_call(*args, kernel, out_shape, grid, **meta):
    x, n, scale = args
    seen.append((kernel, x.shape, type(n), n, scale, grid, meta))
    return jax.pure_callback(lambda x: np.asarray(x) * scale, out_shape, x)

  monkeypatch.setitem(
    sys.modules, "jax_triton", types.SimpleNamespace(triton_call=fake_triton_call)
  )
  xs = jnp.asarray(np.random.default_rng(2).standard_normal((3, 8)), jnp.float32)
  shape = jax.ShapeDtypeStruct((8,), jnp.float32)

  def run(x):
    return triton_call.call(
      _scaled_copy, x, np.int32(8), 2.0, out_shape=shape, grid=(1,), BLOCK=8, num_warps=2
    )

  np.testing.assert_array_equal(np.asarray(run(xs[0])), 2 * np.asarray(xs[0]))
  np.testing.assert_array_equal(np.asarray(jax.vmap(run)(xs)), 2 * np.asarray(xs))
  assert seen and all(
    s == (_scaled_copy, (8,), int, 8, 2.0, (1,), {"BLOCK": 8, "num_warps": 2}) for s in seen
  ), seen


def test_captured_launches_return_placeholders_of_the_declared_outputs():
  """One output for a single `out_shape`, a list for a sequence; each of its shape and dtype."""
  x = jnp.zeros(8, jnp.float32)
  single = jax.ShapeDtypeStruct((8,), jnp.bfloat16)
  several = [jax.ShapeDtypeStruct((8,), jnp.float16), jax.ShapeDtypeStruct((2, 4), jnp.float32)]
  with triton_call.capture():
    one = triton_call.call(_scaled_copy, x, 8, 1.0, out_shape=single, grid=(1,), BLOCK=8)
    many = triton_call.call(_first_half_doubled, x, out_shape=several, grid=(1,), N=8)
  assert (one.shape, one.dtype) == ((8,), jnp.bfloat16)
  assert isinstance(many, list) and [(o.shape, o.dtype) for o in many] == [
    ((8,), jnp.float16),
    ((2, 4), jnp.float32),
  ]
