"""Turns a GPU suite run's summary into the committed record suites/records/<device>/suite_<commit>.json.

python ci/gpu/suite_record.py SUMMARY_JSON --commit SHA --wall-s S --workers N --command CMD
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("summary", help="summary.json of ci/gpu_suite.sh")
  parser.add_argument("--commit", required=True)
  parser.add_argument("--wall-s", type=float, required=True, help="the suite's wall time")
  parser.add_argument("--workers", type=int, required=True)
  parser.add_argument("--command", required=True, help="the device command that ran it")
  args = parser.parse_args(argv)
  with open(args.summary) as f:
    summary = json.load(f)
  device = summary["hardware"]["device_kind"]
  record = {
    "commit": args.commit,
    "device": device,
    "wall_s": args.wall_s,
    "workers": args.workers,
    "command": args.command,
    **summary,
  }
  folder = os.path.join(ROOT, "suites", "records", device.split()[-1].lower())
  os.makedirs(folder, exist_ok=True)
  path = os.path.join(folder, f"suite_{args.commit[:7]}.json")
  with open(path, "w") as f:
    json.dump(record, f, indent=1)
    f.write("\n")
  print(path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
