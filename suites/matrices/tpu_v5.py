"""The TPU v5 matrix: bf16 and f32 (no float64 on TPU; references run in float32)."""

from suites.matrices import h100

# Shapes on TPU are those of the GPU matrix: lane-friendly and with ragged tails.
MATRIX = h100.MATRIX
BENCH = h100.BENCH
