"""The op database's random inputs have the distributions their docstrings state.

The matrices, goldens and kernel tests draw their inputs (and their bias and mask planes)
from these; a draw that hides no key, or no row, leaves the masking code unchecked.
Each share is checked against its documented value with bounds many binomial standard
deviations wide (the draws are fixed-seed, so the checks are deterministic).
"""

import hypothesis
import jax
import numpy as np

from suites import opdb
from suites.opdb import base
from suites.opdb import kernel_cases as kc


def test_random_mask_hides_its_share_of_rows_and_keys():
  shape = (4, 2, 64, 128)  # 512 rows of 128 keys.
  spec = kc.RandomMask(3, shape)
  # By default a mask hides some keys of the live rows and some whole rows.
  assert 0.0 < spec.p < 1.0 and 0.0 < spec.dead_rows < 1.0
  mask = np.asarray(spec.draw())
  assert mask.shape == shape and mask.dtype == bool
  dead = ~mask.any(axis=-1)
  # 512 rows: the dead share's standard deviation is at most 0.022.
  assert abs(float(np.mean(dead)) - spec.dead_rows) < 0.08
  # The live rows' keys are visible with probability p (about 50000 keys: sd 0.002).
  assert abs(float(np.mean(mask[~dead])) - spec.p) < 0.02


def test_random_mask_without_dead_rows_hides_no_row():
  mask = np.asarray(kc.RandomMask(4, (2, 2, 64, 64), p=0.5, dead_rows=0.0).draw())
  assert mask.any(axis=-1).all()
  assert abs(float(np.mean(mask)) - 0.5) < 0.02


def test_random_bias_is_twice_a_standard_normal_plus_its_shift_with_dead_rows():
  shape = (4, 2, 64, 128)
  bias = np.asarray(kc.RandomBias(5, shape, dead_rows=0.25, shift=-30.0).draw())
  assert bias.shape == shape and bias.dtype == np.float32
  dead = np.isneginf(bias).all(axis=-1)
  # Whole rows are -inf or none of their entries are.
  assert not np.isneginf(bias[~dead]).any()
  assert 0.17 < float(np.mean(dead)) < 0.33
  live = bias[~dead]
  # About 49000 values of scale 2: the mean's sd is 0.01, the std's about 0.007.
  assert abs(float(live.mean()) - (-30.0)) < 0.1
  assert abs(float(live.std()) - 2.0) < 0.05


def test_random_bias_without_dead_rows_is_finite_in_its_dtype():
  bias = kc.RandomBias(6, (1, 2, 32, 64), "bfloat16").draw()
  assert bias.dtype == jax.numpy.bfloat16
  values = np.asarray(bias, np.float32)
  assert np.isfinite(values).all()
  assert abs(float(values.mean())) < 0.15 and abs(float(values.std()) - 2.0) < 0.1


def test_draw_normal_bools_ints_and_seeds_follow_their_arguments():
  d = base.Draw(jax.random.key(7))
  x = np.asarray(d.normal((200, 100), "float32"), np.float64)
  assert abs(x.mean()) < 0.02 and abs(x.std() - 1.0) < 0.02
  y = np.asarray(d.normal((200, 100), "float32", scale=3.0), np.float64)
  assert abs(y.std() - 3.0) < 0.06
  b = np.asarray(d.bools((200, 100)))
  assert b.dtype == bool and abs(b.mean() - 0.8) < 0.01
  assert abs(np.asarray(d.bools((200, 100), p=0.3)).mean() - 0.3) < 0.01
  i = np.asarray(d.ints((20000,), 2, 7))
  assert i.dtype == np.int32 and set(np.unique(i).tolist()) == {2, 3, 4, 5, 6}
  seeds = [d.seed() for _ in range(200)]
  assert all(0 <= s < 2**31 - 1 for s in seeds) and len(set(seeds)) == 200
  # Seeds spread over the whole range: some in its top half.
  assert max(seeds) > 2**30


def test_conditioned_widens_the_length_by_the_conditionings_square():
  assert base.conditioned(100, {}) == 100
  assert base.conditioned(100, {"conditioning": 3.0}) == 900
  assert base.conditioned(7, {"conditioning": 0.5, "other": 1}) == 1


def test_gated_linear_unit_property_sizes_reach_one_in_every_dimension():
  """The property tests' GLU shapes can be a single row, a contraction of one and a single
  output column (the degenerate sizes a kernel's tiling mishandles)."""
  sizes = opdb.get("gated_linear_unit").sizes()
  for dim in ("m", "k", "n"):
    # Raises NoSuchExample when the strategy never draws a 1 there.
    hypothesis.find(sizes, lambda s, dim=dim: s[dim] == 1)
