"""dot_product_attention through cuDNN's fused kernels (`jax.nn`)."""

import dataclasses

import jax
import jax.numpy as jnp

from tokamax._src import device
from tokamax._src.ops import op
from tokamax._src.ops.attention import spec


@dataclasses.dataclass(frozen=True, kw_only=True)
class CudnnAttention(op.Op):
  """cuDNN flash attention, via `jax.nn.dot_product_attention(implementation='cudnn')`."""

  name = "cudnn"
  spec = spec.SPEC
  platforms = ("gpu",)
  nondeterministic_gradients = (
    "cuDNN's backward accumulates dq with atomics (XLA_FLAGS=--xla_gpu_deterministic_ops=true "
    "makes it deterministic)"
  )

  def _platform_reason(self, platform, dev):
    if platform == "gpu" and not device.is_nvidia_gpu(dev):
      return "needs an NVIDIA GPU"
    return super()._platform_reason(platform, dev)

  def _unsupported_reason(self, args) -> str | None:
    if (reason := spec.empty_reason(args)) is not None:
      return reason
    h, hv = args.query.shape[-1], args.value.shape[-1]
    if args.query.dtype not in (jnp.bfloat16, jnp.float16):
      return f"dtype {args.query.dtype} (cuDNN takes bfloat16 and float16)"
    if h != hv:
      return f"value head dim {hv} differs from query head dim {h}"
    if h % 8 or h > 256:
      return f"head dim {h} (cuDNN takes multiples of 8 up to 256)"
    if args.soft_cap is not None:
      return "logits_soft_cap"
    if args.local_window is not None and not args.is_causal:
      # cuDNN's sliding window bounds keys on the left only (the causal mask bounds the right).
      return "local_window_size without is_causal"
    t, s = args.query.shape[1], args.key.shape[1]
    for name, x in (("bias", args.bias), ("mask", args.mask)):
      if x is not None and tuple(x.shape[-2:]) != (t, s):
        return (
          f"{name} of shape {tuple(x.shape)} broadcast over positions (cuDNN takes [.., {t}, {s}])"
        )
    if args.q_seq_lengths is not None or args.kv_seq_lengths is not None:
      # jax.nn requires both, and cuDNN leaves padded query rows unspecified.
      return "query/key_value sequence lengths"
    return None

  def _fwd(self, args, config):
    out = jax.nn.dot_product_attention(
      args.query,
      args.key,
      args.value,
      bias=args.bias,
      mask=args.mask,
      scale=args.scale,
      is_causal=args.is_causal,
      local_window_size=args.local_window,
      implementation="cudnn",
    )
    if args.mask is not None:
      out = _zero_hidden_rows(out, args.mask)
    return out, None


def _zero_hidden_rows(out: jax.Array, mask: jax.Array) -> jax.Array:
  """Zeroes the rows whose mask hides every key, and with them their cotangent.

  cuDNN's backward returns garbage dq, dk and dv for such rows (seen on the H200); a zero
  cotangent there makes their softmax gradient vanish.
  """
  visible = jnp.moveaxis(mask.any(axis=-1), -1, 1)[..., None]  # [B|1, T, N|1, 1]
  return jnp.where(visible, out, jnp.zeros((), out.dtype))
