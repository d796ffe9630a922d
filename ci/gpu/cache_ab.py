"""The shipped default cache against the heuristics, interleaved, on the device.

For each default-cache function (`tooling.benchmark_functions`, forward+backward), the
program compiled with the shipped entries and the one compiled with the heuristics
(`use_default_cache=False`) are timed in turn for several rounds (CUPTI kernel time), so
that a tuned entry that measured faster only through the autotuner's order or the GPU's
clock shows here. Writes records in `bench.records`' schema, the heuristic as the anchor.

  python3 ci/gpu/cache_ab.py --out FILE [--functions swiglu,layer_norm_wide] [--rounds 5]
"""

import argparse
import datetime
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tooling

import tokamax
from bench import records
from tokamax._src import benchmarking


def _compiled(fn, arrays, use_default_cache: bool):
  with tokamax.config.override(use_default_cache=use_default_cache):
    return jax.jit(lambda a: fn(a)).lower(arrays).compile()


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  parser.add_argument("--functions", default="")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--iterations", type=int, default=20)
  parser.add_argument("--dry", action="store_true", help="small shapes, wallclock (CPU)")
  opts = parser.parse_args()
  only = set(filter(None, opts.functions.split(","))) or None
  out = []
  method = "wallclock" if opts.dry else "cupti"
  for name, f, sds in tooling.benchmark_functions(dry=opts.dry):
    base = name.removesuffix("_fwd_bwd")
    if not name.endswith("_fwd_bwd") or (only is not None and base not in only):
      continue
    fn, arrays = tokamax.standardize_function(f, *sds)
    programs = {"cached": _compiled(fn, arrays, True), "heuristic": _compiled(fn, arrays, False)}
    rounds = {k: [] for k in programs}
    for r in range(opts.rounds):
      for k in list(programs) if r % 2 == 0 else list(programs)[::-1]:
        times = benchmarking.time_compiled(
          programs[k], arrays, iterations=opts.iterations, method=method
        )
        rounds[k].append(float(np.median(times)))
    med = {k: float(np.median(v)) for k, v in rounds.items()}
    print(
      f"{base}: cached {med['cached']:.4f} ms, heuristic {med['heuristic']:.4f} ms,"
      f" ratio {med['cached'] / med['heuristic']:.3f}",
      flush=True,
    )
    out.append(
      records.Record(
        device=jax.devices()[0].device_kind,
        commit=os.environ.get("TOKAMAX_COMMIT", "unknown"),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        op=base,
        implementation="None (shipped cache)",
        case=base,
        shape={f"arg{i}_dim{j}": d for i, s in enumerate(sds) for j, d in enumerate(s.shape)},
        dtype="bfloat16",
        mode="fwd_bwd",
        median_ms=med["cached"],
        anchor="None (heuristics)",
        anchor_ms=med["heuristic"],
        method=method,
        extra={"rounds_ms": rounds["cached"], "anchor_rounds_ms": rounds["heuristic"]},
      )
    )
    records.write(opts.out, out, note="shipped default cache against the heuristics")


if __name__ == "__main__":
  main()
