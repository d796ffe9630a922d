"""The record types of kernel-specific test cases (`OpInfo.kernel_cases`).

An op's entry maps an implementation to its named cases; a key may name a
purpose after a colon ("triton:compile", "triton:gpu") where one kernel has
several tables. The cases are plain data: the test files draw the arrays
(the random bias and mask planes with their `draw`).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class RandomBias:
  """A random normal bias plane drawn from `seed` (scaled by 2, plus `shift`), a `dead_rows`
  share of its rows -inf (rows that see no key).

  The softmax ignores a shift constant over a row's keys: one far below 0 checks that
  a kernel's running maximum follows the logits down.
  """

  seed: int
  shape: tuple[int, ...]
  dtype: str = "float32"
  dead_rows: float = 0.0
  shift: float = 0.0

  def draw(self):
    key = jax.random.key(self.seed)
    bias = 2.0 * jax.random.normal(key, self.shape) + self.shift
    if self.dead_rows:
      live = jax.random.fold_in(key, 1)
      rows = jax.random.bernoulli(live, 1.0 - self.dead_rows, (*self.shape[:3], 1))
      bias = jax.numpy.where(rows, bias, -jax.numpy.inf)
    return bias.astype(self.dtype)


@dataclasses.dataclass(frozen=True)
class RandomMask:
  """A random mask plane: `p` of keys visible, a `dead_rows` share of rows with none."""

  seed: int
  shape: tuple[int, ...]
  p: float = 0.7
  dead_rows: float = 0.2

  def draw(self):
    keep, live = jax.random.split(jax.random.key(self.seed))
    mask = jax.random.bernoulli(keep, self.p, self.shape)
    return mask & jax.random.bernoulli(live, 1.0 - self.dead_rows, (*self.shape[:3], 1))


@dataclasses.dataclass(frozen=True)
class AttentionKernelCase:
  """One attention kernel case.

  Attributes:
    shape: Dims b, t, s, n, k, h (and hv where the value head dim differs).
    dtype: The input dtype.
    grads: Whether the gradients are checked too.
    features: Keyword options (is_causal, local_window_size, logits_soft_cap,
      precision, sequence lengths, bias and mask planes as the test reads them).
    config: Kernel config fields; empty for the heuristic's config.
  """

  shape: dict
  dtype: str
  grads: bool = True
  features: dict = dataclasses.field(default_factory=dict)
  config: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class LayerNormKernelCase:
  """One layer_norm kernel case (`dtype` None: the test's dtypes)."""

  shape: tuple[int, ...]
  axis: int
  dtype: str | None
  subtract_mean: bool
  has_scale: bool
  has_offset: bool
  scale_offset: float


@dataclasses.dataclass(frozen=True)
class GluKernelCase:
  """One gated_linear_unit kernel case.

  Attributes:
    x_shape: The input's shape (the last dim is K).
    n: The output width (Triton cases; Mosaic cases use 128).
    dtype: The input dtype (None: the test's dtypes).
    activation: The gate's activation (None: identity).
    fused: Weights as one [K, 2, N] array (else a pair of [K, N]).
    backward: The Mosaic backward choice (None: the default).
    config: Kernel config fields (None: the heuristic's config).
  """

  x_shape: tuple[int, ...]
  n: int | None = None
  dtype: str | None = None
  activation: Callable[..., Any] | None = None
  fused: bool = True
  backward: str | tuple[str, ...] | None = None
  config: dict | None = None


@dataclasses.dataclass(frozen=True)
class RaggedDotKernelCase:
  """One ragged_dot kernel case (`dtype` None: the test's dtypes).

  Attributes:
    layout: The `spec` layout (default, rhs_transposed, ragged_contracting).
    m, k, n: The matmul dims (M rows of lhs).
    groups: The number of groups.
    dtype: The input dtype.
    group_offset: The first group (Triton: an int or None; Mosaic: whether one is set).
    config: Kernel config fields (None: the heuristic's config).
  """

  layout: str
  m: int
  k: int
  n: int
  groups: int
  dtype: str | None
  group_offset: int | bool | None
  config: dict | None = None
