"""The A100 matrix (sm_80): the H100 shapes (no Mosaic GPU, which needs sm_90)."""

from suites.matrices import h100

MATRIX = h100.MATRIX
BENCH = h100.BENCH
