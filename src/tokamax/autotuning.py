"""Autotuning: find the best config of every tokamax op in a function."""

from tokamax._src.autotuning.api import AutotuningResult as AutotuningResult
from tokamax._src.autotuning.api import autotune as autotune
