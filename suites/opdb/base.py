"""The record type of the op database: what the suites, goldens and benchmarks know of an op."""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# The hardware families that have a matrix.
CPU = "cpu"
H100 = "h100"  # sm_90: H100 and H200.
A100 = "a100"  # sm_80.
TPU_V5 = "tpu_v5"
FAMILIES = (CPU, H100, A100, TPU_V5)

FWD = "fwd"
FWD_BWD = "fwd_bwd"


class Draw:
  """Random inputs from one key, drawn on the host (no compilation per shape)."""

  def __init__(self, key: jax.Array):
    seed = np.asarray(jax.random.key_data(key)).astype(np.uint64).tolist()
    self.rng = np.random.default_rng(seed)

  def normal(self, shape, dtype, scale=1.0) -> jax.Array:
    x = (scale * self.rng.standard_normal(shape)).astype(np.float32)
    return jnp.asarray(x.astype(jnp.dtype(dtype)))

  def bools(self, shape, p=0.8) -> jax.Array:
    return jnp.asarray(self.rng.random(shape) < p)

  def ints(self, shape, low, high) -> jax.Array:
    return jnp.asarray(self.rng.integers(low, high, shape).astype(np.int32))

  def seed(self) -> int:
    return int(self.rng.integers(0, 2**31 - 1))


def conditioned(length: int, features: dict) -> int:
  """`length` widened by a feature's `conditioning` c (rounding grows c times): c**2 * length.

  The tolerance's atol scales with sqrt(reduction length), so this widens the bound c times
  for inputs whose results cancel terms c times their size (logits in the hundreds).
  """
  return int(length * features.get("conditioning", 1.0) ** 2)


@dataclasses.dataclass(frozen=True)
class Built:
  """One call: public args and kwargs; `names` name the positional args."""

  args: tuple
  kwargs: dict
  diff: tuple[int, ...]
  names: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Matrix:
  """The shapes one hardware family tests an op at.

  Attributes:
    shapes: Shape dicts (an optional "dtypes" key narrows the dtypes of one shape).
    dtypes: The input dtypes.
    interpret_shapes: Small shapes for kernels in interpret mode (CPU).
    interpret_dtypes: The dtypes of those.
    long_shapes: Larger shapes for nightly runs (`--run-long`).
  """

  shapes: tuple[dict, ...]
  dtypes: tuple[str, ...]
  interpret_shapes: tuple[dict, ...] = ()
  interpret_dtypes: tuple[str, ...] = ("float32",)
  long_shapes: tuple[dict, ...] = ()


@dataclasses.dataclass(frozen=True)
class BenchCall:
  """One benchmarked call: shape, dtype, feature and the modes timed."""

  shape: dict
  dtype: str
  feature: str
  modes: tuple[str, ...] = (FWD, FWD_BWD)


@dataclasses.dataclass(frozen=True)
class OpInfo:
  """Everything the test, golden and benchmark machinery knows of one op.

  Attributes:
    name: The op's `SPEC.name`.
    build: (draw, shape, dtype, features) -> Built, arguments of the public signature.
    reference: (args, kwargs) -> the independent reference's value (`tokamax_harness.references`).
    reduction_length: (shape, features) -> the length of the longest reduction.
    has_matmul: Whether the op is matmul-based (float32 tolerance on accelerators).
    features: Feature variants (name -> builder flags); the first two get goldens
      and determinism checks.
    matrices: Family -> the shapes it tests.
    golden_shape: The small shape of goldens and finite-difference checks.
    bench: Family -> the benchmarked calls.
    sizes: () -> a Hypothesis strategy of shape dicts for property tests.
    abstract_call: Abstract inputs (`jax.ShapeDtypeStruct`s) of one small call that every
      implementation's heuristics and autotuning serve: traced, never run.
    config_variants: Implementation -> {label: config fields}: extra configs the
      matrix checks beside the default one (partial chunks, small blocks).
    anchors: Functions outside the library timed beside it by the benchmark
      runner: name -> (args, kwargs) -> output.
    kernel_cases: Implementation (optionally ":purpose") -> {case name -> case}:
      the kernel tests' own cases as data (`suites.opdb.kernel_cases` types).
    bench_features: Features only benchmark calls use (the matrices do not expand them).
  """

  name: str
  build: Callable[[Draw, dict, str, dict], Built]
  reference: Callable[[tuple, dict], Any]
  reduction_length: Callable[[dict, dict], int]
  has_matmul: bool
  features: Mapping[str, dict]
  matrices: Mapping[str, Matrix]
  golden_shape: dict
  bench: Mapping[str, tuple[BenchCall, ...]]
  sizes: Callable[[], Any]
  abstract_call: tuple[jax.ShapeDtypeStruct, ...]
  config_variants: Mapping[str, Mapping[str, dict]] = dataclasses.field(default_factory=dict)
  anchors: Mapping[str, Callable[[tuple, dict], Any]] = dataclasses.field(default_factory=dict)
  kernel_cases: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
  bench_features: Mapping[str, dict] = dataclasses.field(default_factory=dict)

  @property
  def spec(self):
    """The op's declaration in the library's registry."""
    from tokamax._src.ops import registry

    return registry.spec(self.name)

  def abstract_record(self):
    """The spec's validated record of `abstract_call`, of abstract arrays."""
    return jax.eval_shape(self.spec.canonicalize, *self.abstract_call)
