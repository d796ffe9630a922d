"""Autotuning: find the best config of every tokamax op in a function."""

from tokamax._src.autotuning.api import AutotuningData as AutotuningData
from tokamax._src.autotuning.api import AutotuningResult as AutotuningResult
from tokamax._src.autotuning.api import autotune as autotune
from tokamax._src.autotuning.api import find_ops as find_ops
from tokamax._src.autotuning.api import get_bound_args as get_bound_args
