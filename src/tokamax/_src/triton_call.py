"""Calling Triton kernels from JAX, and compiling them without a GPU.

Kernels are written in Triton (`@triton.jit`) and launched through jax-triton,
which passes a kernel its inputs first, then its outputs. jax-triton imports
only where jax has GPU support, so it is imported lazily here.

- `unavailable_reason()` says why Triton kernels cannot run here (or None).
- `call(kernel, *args, out_shape=..., grid=..., **meta)` launches a kernel.
- `compile_for(kernel, signature, constexprs, sm=90)` compiles one for an
  NVIDIA target on any machine (CI compiles every kernel for sm_80 and sm_90).
- `capture()` records the launches `call` would make instead of running them,
  so that wrapper logic runs on a CPU; `compile_launch` compiles a recording.
- Under `jax.vmap`, a launch runs once per batch element (`sequential_under_vmap`).
- `interpret()` runs launches in Triton's interpreter on the host instead
  (as host callbacks under tracing, small shapes, float32/float16: its bfloat16 is unreliable),
  so that CPU tests can check a kernel's numbers; each output lies between guard
  bytes there, and a kernel that stores outside one raises; each float input lies
  between NaNs, which a load past its ends reads.
"""

import contextlib
import dataclasses
import functools
import math
import os
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tokamax._src import device

_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")

_TRITON_TYPES = {
  "bfloat16": "bf16",
  "float64": "fp64",
  "float32": "fp32",
  "float16": "fp16",
  "int64": "i64",
  "int32": "i32",
  "int16": "i16",
  "int8": "i8",
  "uint32": "u32",
  "uint8": "u8",
  "bool": "i1",
}


def pipeline_fits(stage_bytes: int, num_stages: int, cc: tuple[int, int] | None = None) -> bool:
  """Whether a Triton matmul loop of `num_stages` stages fits one block's shared memory.

  Triton keeps every stage's operands in shared memory on Hopper (wgmma) and all but
  one on earlier GPUs (compiled: 192 KiB on sm_90 and 144 KiB on sm_80/sm_89 for four
  stages of 48 KiB).

  Args:
    stage_bytes: Operand bytes of one stage.
    num_stages: Pipeline stages.
    cc: The target compute capability; by default the one kernels are built for.
  """
  cc = device.target_compute_capability() if cc is None else tuple(cc)
  buffers = num_stages if cc >= (9, 0) else num_stages - 1
  return stage_bytes * buffers <= device.shared_memory_per_block(cc)


@functools.cache
def _import_error() -> str | None:
  try:
    import jax_triton  # noqa: F401
  except ImportError as e:
    return f"jax-triton cannot be imported ({e})".replace("\n", " ")
  return None


def unavailable_reason(platform: str | None = None) -> str | None:
  """Why Triton kernels cannot run on `platform` (default backend), or None."""
  platform = platform or jax.default_backend()
  if platform != "gpu":
    return f"Triton kernels run on NVIDIA GPUs, not on {platform}"
  cc = getattr(jax.devices()[0], "compute_capability", None)
  if cc is None:
    return "Triton kernels here need an NVIDIA GPU (no CUDA compute capability)"
  if tuple(int(v) for v in str(cc).split(".")) < (8, 0):
    return f"Triton kernels here need sm_80 or newer, not sm_{str(cc).replace('.', '')}"
  return _import_error()


@dataclasses.dataclass(frozen=True)
class Launch:
  """One recorded kernel launch: what `call` was given."""

  kernel: Any
  args: tuple[Any, ...]
  out_shape: tuple[jax.ShapeDtypeStruct, ...]
  grid: tuple[int, ...]
  meta: dict[str, Any]


_captured: list[list[Launch]] = []
_interpreting: list[bool] = []


@contextlib.contextmanager
def capture() -> Iterator[list[Launch]]:
  """Records launches instead of running them; outputs are random placeholders.

  Yields:
    The list that the launches made inside the block are appended to.
  """
  launches: list[Launch] = []
  _captured.append(launches)
  try:
    yield launches
  finally:
    _captured.pop()


def interpreting() -> bool:
  """Whether launches run in Triton's interpreter (inside `interpret()`)."""
  return bool(_interpreting)


@contextlib.contextmanager
def interpret() -> Iterator[None]:
  """Runs launches made inside the block in Triton's interpreter, on the host.

  The interpreter reads concrete arrays: under tracing (`jax.jit`, `jax.shard_map`) each
  launch runs as a host callback, one at a time. Inside the
  block a Triton implementation asked for by name or instance is accepted on the CPU too.
  """
  _interpreting.append(True)
  try:
    yield
  finally:
    _interpreting.pop()


class _HostTensor:
  """The slice of the torch tensor interface that Triton's interpreter reads."""

  def __init__(self, array: np.ndarray):
    self.array = array

  def data_ptr(self) -> int:
    return self.array.ctypes.data

  @property
  def dtype(self) -> Any:
    return _torch_dtype(self.array.dtype.name)


@functools.cache
def _torch_dtype(name: str) -> Any:
  # One lasting object per dtype: Triton caches types by object, and a freed
  # one's address can come back as another dtype.
  return type("dtype", (), {"__str__": lambda _: f"torch.{name}"})()


def _language_namespaces() -> list[Any]:
  """The modules and classes of `triton.language` that Triton's interpreter patches."""
  import triton.language as tl

  return [tl, tl.core, tl.math, tl.standard, tl.tensor, tl.core.tensor_descriptor_base]


@contextlib.contextmanager
def _language_restored() -> Iterator[None]:
  """Puts `triton.language` back as it was after the block.

  Triton's interpreter patches the language for every jitted helper a kernel calls
  and never restores those patches (triton 3.6, `InterpretedFunction.__call__`);
  left in place, they break every later compile in the process.
  Names the interpreter adds (its semantic object) stay: later interpreted runs need them.
  """
  saved = [(ns, dict(vars(ns))) for ns in _language_namespaces()]
  try:
    yield
  finally:
    for ns, before in saved:
      for name, value in before.items():
        if vars(ns).get(name, _MISSING) is not value:
          setattr(ns, name, value)


_MISSING = object()


def _run_interpreted(kernel, args, shapes, grid, meta) -> list[jax.Array]:
  import triton
  from triton.runtime import interpreter

  class Executor(interpreter.GridExecutor):
    def _init_args_hst(self, args_dev, kwargs):
      return args_dev, kwargs

    def _restore_args_dev(self, *unused):
      pass

  # The interpreter takes Python scalars only; its floats are float32.
  inputs = [
    np.array(a) if _is_array(a) else a.item() if isinstance(a, np.generic) else a for a in args
  ]
  guarded = [_guarded_output(s.shape, s.dtype) for s in shapes]
  outputs = [output for output, _, _ in guarded]
  wrapped = [_HostTensor(_guarded_input(a)) if isinstance(a, np.ndarray) else a for a in inputs]
  wrapped += [_HostTensor(o) for o in outputs]
  fn = interpreter.InterpretedFunction(kernel.fn)
  constexprs = {k: v for k, v in meta.items() if k in fn.arg_names}
  patch_tensor = interpreter._patch_lang_tensor

  def patch_tensor_index(tensor, scope):
    # Scalars are 1-element arrays there, which numpy >= 2.5 no longer turns into ints.
    patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.ravel(self.handle.data)[0]))

  interpreter._patch_lang_tensor = patch_tensor_index
  # `triton.jit` functions the kernel calls (its module's helpers, and Triton's
  # own such as tl.zeros or tl.sum) are interpreted too, for the call. Gluon
  # loads first: it checks on import that Triton's own are jitted.
  with contextlib.suppress(ImportError):
    import triton.experimental.gluon
  namespaces = (kernel.fn.__globals__, vars(triton.language), vars(triton.language.standard))
  jitted = [
    {k: v for k, v in ns.items() if isinstance(v, triton.runtime.JITFunction) and v is not kernel}
    for ns in namespaces
  ]
  for ns, functions in zip(namespaces, jitted, strict=True):
    ns.update({k: interpreter.InterpretedFunction(v.fn) for k, v in functions.items()})
  try:
    with _language_restored():
      Executor(fn.fn, fn.arg_names, _normalize_grid(grid, meta))(*wrapped, **constexprs)
  finally:
    interpreter._patch_lang_tensor = patch_tensor
    for ns, functions in zip(namespaces, jitted, strict=True):
      ns.update(functions)
  for i, (_, raw, margin) in enumerate(guarded):
    if not (_margins_intact(raw[:margin]) and _margins_intact(raw[-margin:])):
      raise RuntimeError(
        f"{kernel.fn.__name__} wrote outside its output {i} {shapes[i].shape} (out of bounds)."
      )
  return [jnp.asarray(o) for o in outputs]


# Bytes written around each interpreted output; a store outside the output changes them.
_GUARD_BYTE = 0xA5


def _guarded(shape, dtype) -> tuple[np.ndarray, np.ndarray, int]:
  """An array between two margins of guard bytes of at least 4 KiB each (as large as the
  array): (the array, the whole raw buffer, the margin in bytes)."""
  dtype = np.dtype(dtype)
  nbytes = math.prod(shape) * dtype.itemsize
  margin = max(4096, -(-nbytes // 64) * 64)
  raw = np.full(nbytes + 2 * margin, _GUARD_BYTE, np.uint8)
  return raw[margin : margin + nbytes].view(dtype).reshape(shape), raw, margin


def _guarded_output(shape, dtype) -> tuple[np.ndarray, np.ndarray, int]:
  """A guarded output array of NaN (integers: -1), so that unwritten elements show."""
  output, raw, margin = _guarded(shape, dtype)
  output[...] = np.nan if np.issubdtype(output.dtype, np.inexact) else -1
  return output, raw, margin


def _guarded_input(a: np.ndarray) -> np.ndarray:
  """A contiguous copy of `a` between margins of NaN (other dtypes: guard bytes), so that
  an unmasked load past its ends reads NaN, not a neighbouring buffer's numbers that a
  select or a product with zero would hide (on a GPU, such a load may read anything)."""
  copy, raw, margin = _guarded(a.shape, a.dtype)
  copy[...] = a
  if jnp.issubdtype(a.dtype, jnp.inexact):
    for side in (raw[:margin], raw[-margin:]):
      side.view(a.dtype)[...] = np.nan
  return copy


def _margins_intact(margin: np.ndarray) -> bool:
  return bool(np.all(margin == _GUARD_BYTE))


# Triton's interpreter patches module globals: one launch at a time (devices run callbacks
# side by side).
_interpreter_lock = threading.Lock()


def _interpreted(kernel, args, shapes, grid, meta) -> list[jax.Array]:
  """Runs a launch in the interpreter; under tracing (jit, shard_map), as a host callback."""
  positions = [i for i, a in enumerate(args) if isinstance(a, jax.core.Tracer)]

  def run(*arrays):
    full = list(args)
    for i, a in zip(positions, arrays, strict=True):
      full[i] = a
    with _interpreter_lock:
      return [np.asarray(o) for o in _run_interpreted(kernel, full, shapes, grid, meta)]

  if not positions:
    return [jnp.asarray(o) for o in run()]
  out = jax.pure_callback(
    run,
    [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in shapes],
    *(args[i] for i in positions),
    vmap_method="sequential",
  )
  return list(out)


def _normalize_grid(grid: Any, meta: dict[str, Any]) -> tuple[int, ...]:
  if callable(grid):
    grid = grid(meta)
  if isinstance(grid, int | np.integer):
    grid = (grid,)
  return tuple(int(g) for g in grid)


def call(
  kernel: Callable,
  *args: Any,
  out_shape: jax.ShapeDtypeStruct | Sequence[jax.ShapeDtypeStruct],
  grid: Any,
  **meta: Any,
) -> Any:
  """Launches `kernel(*args, *outputs, **meta)` through jax-triton.

  Args:
    kernel: A `triton.jit` function taking the inputs, then the outputs.
    *args: Arrays and scalars (Python or numpy), in the kernel's order.
    out_shape: One `jax.ShapeDtypeStruct` or a sequence of them.
    grid: The launch grid, or a function of `meta` returning it.
    **meta: Constexpr values, and `num_warps`/`num_stages`/`num_ctas`; jax-triton
      options such as `zeroed_outputs` or `input_output_aliases` pass through.

  Returns:
    The output array, or a list of them when `out_shape` is a sequence.
  """
  single = not isinstance(out_shape, Sequence)
  shapes = (out_shape,) if single else tuple(out_shape)
  args = tuple(map(_plain_scalar, args))
  if _captured:
    _captured[-1].append(Launch(kernel, tuple(args), shapes, _normalize_grid(grid, meta), meta))
    key = jax.random.key(len(_captured[-1]))
    outs = [
      jax.random.normal(jax.random.fold_in(key, i), s.shape, jnp.float32).astype(s.dtype)
      for i, s in enumerate(shapes)
    ]
    return outs[0] if single else outs
  if _interpreting:
    outs = _interpreted(kernel, args, shapes, grid, meta)
    return outs[0] if single else outs
  import jax_triton

  positions = [i for i, a in enumerate(args) if _is_array(a)]

  def launch(*arrays):
    full = list(args)
    for i, a in zip(positions, arrays, strict=True):
      full[i] = a
    return jax_triton.triton_call(*full, kernel=kernel, out_shape=out_shape, grid=grid, **meta)

  return sequential_under_vmap(launch)(*(args[i] for i in positions))


def sequential_under_vmap(fn: Callable[..., Any]) -> Callable[..., Any]:
  """`fn` of arrays, which `jax.vmap` runs once per batch element (jax-triton has no batching).

  Unbatched arguments are passed whole to every call, not broadcast.
  """
  wrapped = jax.custom_batching.custom_vmap(fn)

  @wrapped.def_vmap
  def _rule(axis_size, in_batched, *arrays):
    del axis_size

    def one(batched_slices):
      it = iter(batched_slices)
      return wrapped(*(next(it) if b else a for a, b in zip(arrays, in_batched, strict=True)))

    outs = jax.lax.map(one, [a for a, b in zip(arrays, in_batched, strict=True) if b])
    return outs, jax.tree.map(lambda _: True, outs)

  return wrapped


def _is_array(value: Any) -> bool:
  """Whether `value` is an array argument (a pointer): numpy scalars are scalars."""
  return hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, np.generic)


def _plain_scalar(value: Any) -> Any:
  """A numpy scalar as the Python one jax-triton types alike (it takes float32 as is)."""
  if isinstance(value, np.generic) and not isinstance(value, np.float32):
    return value.item()
  return value


def _type_of(value: Any) -> str:
  if _is_array(value):
    return "*" + _TRITON_TYPES[np.dtype(value.dtype).name]
  if isinstance(value, bool | np.bool_):
    return "i1"
  if isinstance(value, int | np.integer):
    return "i32" if -(2**31) <= value < 2**31 else "i64"
  if isinstance(value, np.float32):
    return "fp32"
  if isinstance(value, float):
    return "fp64"
  raise TypeError(f"no Triton type for {value!r}")


def compile_for(
  kernel: Any,
  signature: dict[str, str],
  constexprs: dict[str, Any],
  sm: int = 90,
  *,
  num_warps: int = 4,
  num_stages: int = 3,
  aligned: Sequence[str] | None = None,
) -> Any:
  """Compiles `kernel` for an NVIDIA target; works without a GPU.

  Args:
    kernel: A `triton.jit` function.
    signature: Runtime argument name to Triton type ("*bf16", "i32", ...).
    constexprs: Constexpr argument name to value.
    sm: Compute capability as an int: 80 (A100) or 90 (H100/H200).
    num_warps: Warps per program.
    num_stages: Software-pipelining depth.
    aligned: Arguments assumed 16-byte aligned/divisible, as jax-triton assumes
      for every array; None means every pointer argument.

  Returns:
    The compiled kernel (`.asm` holds "ttgir", "ptx", "cubin"; `.metadata`).
  """
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.compiler import ASTSource

  full = dict(signature)
  for name in constexprs:
    full[name] = "constexpr"
  if aligned is None:
    aligned = [n for n, t in signature.items() if t.startswith("*")]
  names = list(kernel.arg_names)
  attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
  ordered = {n: full[n] for n in names if n in full}
  missing = [n for n in names if n not in full]
  if missing:
    raise ValueError(f"{kernel.__name__}: no type or value for arguments {missing}")
  src = ASTSource(fn=kernel, signature=ordered, constexprs=dict(constexprs), attrs=attrs)
  target = GPUTarget("cuda", sm, 32)  # NVIDIA warps are 32 threads on every target.
  with _triton_cache_dir():
    return triton.compile(
      src, target=target, options={"num_warps": num_warps, "num_stages": num_stages}
    )


@contextlib.contextmanager
def _triton_cache_dir() -> Iterator[None]:
  """A cache directory for `triton.compile`: importing jax-triton empties TRITON_CACHE_DIR."""
  before = os.environ.get("TRITON_CACHE_DIR")
  if before:
    yield
    return
  os.environ["TRITON_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), "tokamax_triton_cache")
  try:
    yield
  finally:
    if before is None:
      del os.environ["TRITON_CACHE_DIR"]
    else:
      os.environ["TRITON_CACHE_DIR"] = before


def compile_launch(launch: Launch, sm: int = 90) -> Any:
  """Compiles a launch recorded by `capture` exactly as jax-triton would run it."""
  names = list(launch.kernel.arg_names)
  values = [*launch.args, *launch.out_shape]
  signature, constexprs = {}, {}
  for name, value in zip(names, values, strict=False):
    if not _is_array(value) and not isinstance(value, bool) and value == 1:
      constexprs[name] = 1  # jax-triton specializes scalars equal to 1.
    else:
      signature[name] = _type_of(value)
  options = {k: v for k, v in launch.meta.items() if k in _LAUNCH_OPTIONS}
  for name, value in launch.meta.items():
    if name in names:
      constexprs[name] = value
  return compile_for(
    launch.kernel,
    signature,
    constexprs,
    sm,
    num_warps=options.get("num_warps", 4),
    num_stages=options.get("num_stages", 3),
  )
