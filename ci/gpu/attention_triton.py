"""GPU checks and timings of the Triton flash attention (`implementation="triton"`).

Run on an NVIDIA GPU with jax-triton installed:
  python3 ci/gpu/attention_triton.py --out DIR [--commit SHA] [--skip-tests] [--matrix]

1. The GPU tests of `suites/kernels/test_attention_triton.py` (pytest, several
   workers so that kernels compile in parallel), outputs and gradients against
   XLA on float32-upcast inputs at HIGHEST precision.
2. Timings (device time from the profiler trace, `harness.timing`, median over
   rotated input sets) at B4 T4096 N32 H128 bfloat16, causal and not: our
   kernels with a few configs, cuDNN (`jax.nn.dot_product_attention`) and XLA
   as anchors in the same run. TFLOP/s count 4*B*N*T*S*H for the forward
   (causal: the visible pairs, about half) and 3.5 times that for
   forward+backward.
3. With --matrix, the h100 matrix's attention cases for "triton".
Writes attention_triton.json (and pytest logs) to DIR.
"""

import argparse
import dataclasses
import os
import subprocess
import sys
import traceback

import jax
import jax.numpy as jnp

import tokamax
from ci.gpu import run_record
from harness import timing
from tokamax._src.ops.attention import spec
from tokamax._src.ops.attention import triton as attention_triton

RECORD = run_record.Record("attention_triton.json", tests={}, timings=[])
RESULTS, save, log = RECORD.results, RECORD.save, RECORD.log


def run_pytest(name: str, args: list[str], workers: int) -> None:
  """Runs pytest in a subprocess; records its exit code and summary line."""
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(workers), *args]
  log("pytest", name, " ".join(cmd))
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
  if proc.returncode == 4:  # A usage error (no pytest-xdist?): once more, in one process.
    cmd = [c for c in cmd if c not in ("-n", str(workers))]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
  with open(os.path.join(os.path.dirname(RECORD.path), f"pytest_{name}.txt"), "w") as f:
    f.write(proc.stdout + proc.stderr)
  tail = [line for line in proc.stdout.splitlines() if line.strip()][-25:]
  RESULTS["tests"][name] = {"returncode": proc.returncode, "tail": tail}
  save()
  print("\n".join(tail[-12:]), flush=True)


def _flops(args: spec.AttentionArgs) -> tuple[float, float]:
  fwd = spec.cost(args).flops
  return fwd, 3.5 * fwd


def bench(dry: bool) -> None:
  b, t, n, h = (1, 256, 4, 64) if dry else (4, 4096, 32, 128)
  dtype = jnp.bfloat16
  keys = iter(jax.random.split(jax.random.key(0), 64))

  def rnd(shape):
    return jax.random.normal(next(keys), shape, jnp.float32).astype(dtype)

  argsets = [tuple(rnd((b, t, n, h)) for _ in range(4)) for _ in range(2)]  # q, k, v, dout
  for causal in (False, True):
    record = spec.canonicalize(*argsets[0][:3], is_causal=causal)
    fwd_flops, total_flops = _flops(record)
    heuristic = attention_triton.heuristic_config(record, 9)
    impls = {}
    if not dry:
      impls["cudnn"] = lambda q, k, v, c=causal: jax.nn.dot_product_attention(
        q, k, v, is_causal=c, implementation="cudnn"
      )
    impls["xla"] = lambda q, k, v, c=causal: tokamax.dot_product_attention(
      q, k, v, is_causal=c, implementation="xla"
    )
    variants = [
      ("triton", heuristic, True),
      ("triton-fwd-128x64", dataclasses.replace(heuristic, block_k=64), False),
      ("triton-fwd-s2", dataclasses.replace(heuristic, num_stages=2), False),
      (
        "triton-bwd-128x64s2",
        dataclasses.replace(heuristic, bwd_block_inner=64, bwd_num_stages=2),
        True,
      ),
      ("triton-bwd-128x32s2", dataclasses.replace(heuristic, bwd_num_stages=2), True),
      (
        "triton-bwd-64x64s3",
        dataclasses.replace(heuristic, bwd_block_outer=64, bwd_block_inner=64),
        True,
      ),
    ]
    if not dry:
      for name, config, _ in variants:
        op = attention_triton.TritonAttention(config=config)
        impls[name] = lambda q, k, v, c=causal, op=op: tokamax.dot_product_attention(
          q, k, v, is_causal=c, implementation=op
        )
    row = {"shape": dict(b=b, t=t, s=t, n=n, k=n, h=h), "dtype": "bfloat16", "causal": causal}
    row["flops"] = {"fwd": fwd_flops, "fwd_bwd": total_flops, "convention": "fwd_bwd = 3.5 * fwd"}
    row["configs"] = {name: dataclasses.asdict(c) for name, c, _ in variants}
    with_bwd = {name for name, _, bwd in variants if bwd} | {"cudnn", "xla"}
    for name, f in impls.items():
      modes = {"fwd": (jax.jit(f), [a[:3] for a in argsets], fwd_flops)}
      if name in with_bwd:
        step = run_record.forward_backward(f, (0, 1, 2))
        modes["fwd_bwd"] = (jax.jit(step), argsets, total_flops)
      for mode, (fn, args, flops) in modes.items():
        try:
          tm = timing.device_time(fn, args, warmup=2, iterations=10)
          entry = tm.as_dict() | {"tflops": flops / tm.median_s / 1e12}
        except Exception as e:
          traceback.print_exc()
          entry = {"error": f"{type(e).__name__}: {e}"[:1500]}
        row[f"{name}.{mode}"] = entry
        log(
          f"causal={causal} {name}.{mode}",
          {k: entry.get(k) for k in ("median_ms", "tflops", "method", "error")},
        )
        RESULTS["timings"] = [r for r in RESULTS["timings"] if r is not row] + [row]
        save()
    for mode in ("fwd", "fwd_bwd"):
      anchor = row.get(f"cudnn.{mode}", {}).get("median_ms")
      ours = row.get(f"triton.{mode}", {}).get("median_ms")
      if anchor and ours:
        row[f"triton_over_cudnn_time.{mode}"] = ours / anchor
    save()


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default=os.environ.get("OUT", "."))
  parser.add_argument("--commit", default=None)
  parser.add_argument("--skip-tests", action="store_true")
  parser.add_argument("--skip-bench", action="store_true")
  parser.add_argument("--matrix", action="store_true")
  parser.add_argument("--workers", type=int, default=8)
  parser.add_argument("--dry", action="store_true", help="CPU plumbing check: small, XLA only")
  a = parser.parse_args()
  os.makedirs(a.out, exist_ok=True)
  RECORD.path = os.path.join(a.out, "attention_triton.json")
  dev = jax.devices()[0]
  RESULTS["device"] = f"{dev.device_kind} ({dev.platform})"
  RESULTS["commit"] = a.commit
  RESULTS["versions"] = {"jax": jax.__version__}
  log(RESULTS["device"], a.commit)
  save()
  if not a.skip_tests and not a.dry:
    run_pytest("kernel_gpu", ["suites/kernels/test_attention_triton.py", "-k", "gpu"], a.workers)
  if not a.skip_bench:
    try:
      bench(a.dry)
    except Exception as e:
      traceback.print_exc()
      RESULTS["errors"].append(f"bench: {type(e).__name__}: {e}"[:2000])
  if a.matrix and not a.dry:
    run_pytest(
      "h100_matrix",
      ["suites/test_matrix.py", "-k", "dot_product_attention and triton"],
      a.workers,
    )
  save()
  log("done")
  for row in RESULTS["timings"]:
    print(
      f"causal={row['causal']}: "
      + "  ".join(
        f"{k}={v['median_ms']:.3f}ms/{v['tflops']:.0f}TF"
        for k, v in row.items()
        if isinstance(v, dict) and "median_ms" in v
      ),
      flush=True,
    )


if __name__ == "__main__":
  main()
