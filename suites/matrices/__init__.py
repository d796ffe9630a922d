"""The hardware matrices: op x implementation x shapes x dtypes x features.

Each op's entry in the op database (`suites.opdb`) declares, per hardware family
(`cpu`, `h100`, `a100`, `tpu_v5`), its shapes, dtypes and features, its
benchmark calls and extra configs to check; `cases` expands them into `Case`s;
`implementations` resolves each registered implementation for the hardware at
hand; `checks` holds the checks every suite runs on a (case, implementation).

Typical use:

  for case in matrices.for_family("cpu", op="layer_norm"):
    args, kwargs = case.make_args(jax.random.key(0))
    expected = case.reference(args, kwargs)
"""

from suites.matrices.cases import INTERPRET as INTERPRET
from suites.matrices.cases import LONG as LONG
from suites.matrices.cases import NATIVE as NATIVE
from suites.matrices.cases import BenchCase as BenchCase
from suites.matrices.cases import Case as Case
from suites.matrices.cases import bench_cases as bench_cases
from suites.matrices.cases import for_family as for_family
from suites.matrices.cases import gradient_cases as gradient_cases
from suites.matrices.implementations import Implementation as Implementation
from suites.matrices.implementations import all_for as all_for
from suites.matrices.implementations import resolve as resolve
