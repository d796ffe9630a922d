"""Benchmarking of functions that contain tokamax ops."""

from tokamax._src.benchmarking import BenchmarkData as BenchmarkData
from tokamax._src.benchmarking import benchmark as benchmark
from tokamax._src.benchmarking import compile_benchmark as compile_benchmark
from tokamax._src.benchmarking import standardize_function as standardize_function
