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
    return None

  def _fwd(self, args, config):
    window = args.local_window
    if window is not None:
      # The causal mask bounds the right; jax.nn takes no right bound with lengths.
      window = (window[0], 0)
    out = jax.nn.dot_product_attention(
      args.query,
      args.key,
      args.value,
      bias=args.bias,
      mask=args.mask,
      scale=args.scale,
      is_causal=args.is_causal,
      local_window_size=window,
      implementation="cudnn",
      **_lengths(args),
    )
    return zero_unseen_rows(out, args), None


def _lengths(args) -> dict[str, jax.Array]:
  """jax.nn's sequence-length arguments: both or neither, within [0, T] and [0, S]."""
  if args.q_seq_lengths is None and args.kv_seq_lengths is None:
    return {}
  b, t, s = args.query.shape[0], args.query.shape[1], args.key.shape[1]

  def clipped(lengths, full):
    if lengths is None:
      return jnp.full((b,), full, jnp.int32)
    return jnp.clip(lengths, 0, full).astype(jnp.int32)

  return dict(
    query_seq_lengths=clipped(args.q_seq_lengths, t),
    key_value_seq_lengths=clipped(args.kv_seq_lengths, s),
  )


def zero_unseen_rows(out: jax.Array, args) -> jax.Array:
  """`out` with zeros in the rows that see no key (see `seen_rows`)."""
  seen = seen_rows(args)
  return out if seen is None else jnp.where(seen, out, jnp.zeros((), out.dtype))


def seen_rows(args) -> jax.Array | None:
  """[B|1, T, N|1, 1]: whether each query row sees some key, or None where all do.

  cuDNN leaves rows that see nothing unspecified, and its backward returns garbage dq,
  dk and dv for them (seen on the H200): they get zero output, and so a zero cotangent,
  which makes their softmax gradient vanish.
  """
  positional = (args.local_window, args.q_seq_lengths, args.kv_seq_lengths)
  if args.mask is None and all(x is None for x in positional):
    return None  # Causal alone: every row sees key 0.
  t, s = args.query.shape[1], args.key.shape[1]
  ok = spec.visible(args, jnp.arange(t), jnp.arange(s))
  if args.mask is not None:
    ok = args.mask if ok is None else ok & args.mask
  return jnp.moveaxis(ok.any(axis=-1), -1, 1)[..., None]
