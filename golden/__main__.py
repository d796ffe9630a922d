"""`python -m golden`: checks the goldens of the hardware at hand; `--regen` rewrites them.

Exit status 1 when a golden fails, errors or is missing, or when the family has
no goldens at all.
"""

import argparse
import sys

from golden import golden
from harness import hardware


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m golden", description=__doc__)
  parser.add_argument("--regen", action="store_true", help="regenerate and print what changed")
  parser.add_argument("--family", default=None, help="default: the hardware at hand's")
  parser.add_argument("--data", default=golden.DATA_DIR, help="the stored goldens")
  parser.add_argument("--out", default=None, help="--regen writes here (default: --data)")
  parser.add_argument("--ops", default=None, help="comma-separated op names (default: all)")
  args = parser.parse_args(argv)
  profile = hardware.detect()
  family = args.family or profile.family
  ops = args.ops.split(",") if args.ops else None
  where = f"{profile.describe()}, jax {golden.jax.__version__}"
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


if __name__ == "__main__":
  sys.exit(main())
