"""`python -m golden`: checks the goldens of the hardware at hand; `--regen` rewrites them.

Exit status 1 when a golden fails, errors or is missing, or when the family has
no goldens at all.
"""

import argparse
import concurrent.futures
import os
import subprocess
import sys
import tempfile

from golden import golden
from tokamax_harness import hardware


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m golden", description=__doc__)
  parser.add_argument("--regen", action="store_true", help="regenerate and print what changed")
  parser.add_argument("--family", default=None, help="default: the hardware at hand's")
  parser.add_argument("--data", default=golden.DATA_DIR, help="the stored goldens")
  parser.add_argument("--out", default=None, help="--regen writes here (default: --data)")
  parser.add_argument("--ops", default=None, help="comma-separated op names (default: all)")
  parser.add_argument(
    "--jobs", type=int, default=1, help="--regen: one process per op, this many at once"
  )
  args = parser.parse_args(argv)
  profile = hardware.detect()
  family = args.family or profile.family
  ops = args.ops.split(",") if args.ops else None
  where = f"{profile.describe()}, jax {golden.jax.__version__}"
  if args.regen and args.jobs > 1:
    return _regen_in_parallel(family, ops or list(golden.opdb.OPS), args)
  if args.regen:
    changes = golden.regenerate(family, data_dir=args.data, out_dir=args.out, ops=ops)
    dest = golden.family_dir(family, args.out or args.data)
    print(golden.table(changes, title=f"golden --regen for {family} on {where} -> {dest}"))
    return 1 if any(r.status == golden.ERROR for r in changes) else 0
  results, manifest = golden.check(family, data_dir=args.data, ops=ops)
  print(golden.table(results, title=f"golden check for {family} on {where}"))
  if manifest is None:
    print(
      f"MISSING: no goldens for hardware family {family!r} in "
      f"{golden.family_dir(family, args.data)}; make them with `nox -s golden -- --regen` "
      "on that hardware."
    )
    return 1
  print(
    f"goldens made at commit {manifest['commit'][:12]} on {manifest['device_kind']}, "
    f"jax {manifest['jax_version']}"
  )
  failing = [r for r in results if r.status in golden.FAILING]
  if failing:
    print(f"FAILED: {len(failing)} golden(s) failed, errored or are missing.")
    return 1
  print("OK")
  return 0


def _regen_in_parallel(family: str, ops: list[str], args) -> int:
  """Regenerates each op's goldens in its own process (sharing the device), then merges them."""
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{0.9 / min(args.jobs, len(ops)):.3f}"
  with tempfile.TemporaryDirectory() as tmp:

    def regen(op):
      cmd = [sys.executable, "-m", "golden", "--regen", "--family", family, "--data", args.data]
      cmd += ["--ops", op, "--out", os.path.join(tmp, op)]
      return subprocess.run(cmd, env=env, capture_output=True, text=True)

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
      done = dict(zip(ops, pool.map(regen, ops), strict=True))
    for proc in done.values():
      print(proc.stdout + proc.stderr)
    failed = [op for op, proc in done.items() if proc.returncode]
    unwritten = [
      op for op in ops if not os.path.exists(golden.family_dir(family, os.path.join(tmp, op)))
    ]
    if unwritten:
      print(f"FAILED: no goldens written for {unwritten}")
      return 1
    parts = {op: os.path.join(tmp, op) for op in ops}
    golden.merge(family, parts, data_dir=args.data, out_dir=args.out)
  print(
    f"merged the goldens of {len(ops)} ops into {golden.family_dir(family, args.out or args.data)}"
  )
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
