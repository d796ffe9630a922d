"""The op database: one entry per op (`OpInfo`) that tests, goldens and benchmarks read.

Each op's file holds its input builder, feature variants, reference, per-family
shapes, golden shape, benchmark calls, Hypothesis sizes and extra configs to
check. Adding a feature to an op touches its spec, its implementations, its
reference and its entry here; the matrix, properties, goldens and benchmarks
pick it up.
"""

from suites.opdb import (
  attention,
  gated_linear_unit,
  layer_norm,
  linear_softmax_cross_entropy_loss,
  ragged_dot,
)
from suites.opdb.base import (
  A100 as A100,
)
from suites.opdb.base import (
  CPU as CPU,
)
from suites.opdb.base import (
  FAMILIES as FAMILIES,
)
from suites.opdb.base import (
  FWD as FWD,
)
from suites.opdb.base import (
  FWD_BWD as FWD_BWD,
)
from suites.opdb.base import (
  H100 as H100,
)
from suites.opdb.base import (
  TPU_V5 as TPU_V5,
)
from suites.opdb.base import (
  BenchCall as BenchCall,
)
from suites.opdb.base import (
  Built as Built,
)
from suites.opdb.base import (
  Draw as Draw,
)
from suites.opdb.base import (
  Matrix as Matrix,
)
from suites.opdb.base import (
  OpInfo as OpInfo,
)

ALL: dict[str, OpInfo] = {
  info.name: info
  for info in (
    attention.INFO,
    layer_norm.INFO,
    gated_linear_unit.INFO,
    ragged_dot.INFO,
    linear_softmax_cross_entropy_loss.INFO,
  )
}
OPS = tuple(ALL)


def get(op: str) -> OpInfo:
  """The entry of `op`; a clear error for names the database lacks."""
  if op not in ALL:
    raise KeyError(f"no op-database entry for {op!r}; entries: {', '.join(ALL)}")
  return ALL[op]
