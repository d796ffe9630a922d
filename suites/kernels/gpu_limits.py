"""Hardware facts the kernel tests hold compiled kernels to, written independently of the library."""

# Shared memory a block may opt into, in bytes, by sm (CUDA's technical specifications per
# compute capability): 163 KiB on sm_80, 99 KiB on sm_86/89/120, 227 KiB on sm_90/100.
SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
