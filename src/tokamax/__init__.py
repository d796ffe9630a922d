"""tokamax: fast accelerator kernels for JAX."""

from tokamax import autotuning as autotuning
from tokamax import benchmarking as benchmarking
from tokamax import config as config
from tokamax._src.autotuning.api import AutotuningResult as AutotuningResult
from tokamax._src.autotuning.api import autotune as autotune
from tokamax._src.benchmarking import BenchmarkData as BenchmarkData
from tokamax._src.benchmarking import benchmark as benchmark
from tokamax._src.benchmarking import standardize_function as standardize_function
from tokamax._src.export import DISABLE_JAX_EXPORT_CHECKS as DISABLE_JAX_EXPORT_CHECKS
from tokamax._src.ops.attention.api import (
  Implementation as DotProductAttentionImplementation,  # noqa: F401 (public re-export)
)
from tokamax._src.ops.attention.api import dot_product_attention as dot_product_attention
from tokamax._src.ops.gated_linear_unit.api import gated_linear_unit as gated_linear_unit
from tokamax._src.ops.linear_softmax_cross_entropy_loss.api import (
  linear_softmax_cross_entropy_loss as linear_softmax_cross_entropy_loss,
)
from tokamax._src.ops.normalization.api import layer_norm as layer_norm
from tokamax._src.ops.op import BoundArguments as BoundArguments
from tokamax._src.ops.op import Op as Op
from tokamax._src.ops.ragged_dot.api import ragged_dot as ragged_dot
from tokamax._src.ops.ragged_dot.api import ragged_dot_general as ragged_dot_general
from tokamax._src.ops.ragged_dot.spec import RaggedDotGroupSizes as RaggedDotGroupSizes
from tokamax._src.ops.ragged_dot.spec import (
  generate_ragged_dot_group_sizes as generate_ragged_dot_group_sizes,
)
from tokamax._src.version import __version__ as __version__
