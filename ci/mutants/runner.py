"""Runs the mutation catalogue: one planted bug at a time, in throwaway copies.

Each worker gets its own copy of the repository (the working tree's files, or
HEAD with `--source head`) under a temporary directory. For each mutation it
replaces the mutation's `old` text by `new`, runs the mutation's pytest
selection there and restores the file. A mutant is

  KILLED    when the selection fails (a test failed, or crashed the interpreter),
  SURVIVED  when it passes,
  ERROR     when pytest could not run it (collection or import error of the
            test module, usage error, nothing selected, every test skipped):
            not a kill,
  TIMEOUT   when it ran past `--timeout`: not a kill,
  STALE     when `old` does not occur exactly once in its file (checked for
            every mutation before anything runs).

Before anything runs, the unmutated copy must collect every selected test
file (else the run stops with exit status 2). With `--baseline` each
unmutated selection also runs first and must pass (else BASELINE). The exit
status is non-zero unless every mutant was killed.

  python -m ci.mutants [--jobs 2] [--only ID,...] [--list] [--out summary.json]
"""

import argparse
import concurrent.futures
import dataclasses
import json
import os
import pathlib
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from ci.mutants import catalogue

ROOT = pathlib.Path(__file__).resolve().parents[2]
KILLED, SURVIVED, ERROR, TIMEOUT, STALE, BASELINE = (
  "KILLED",
  "SURVIVED",
  "ERROR",
  "TIMEOUT",
  "STALE",
  "BASELINE",
)
_SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed|error|errors|skipped|deselected).*?)\s*=*$")


class PreflightError(RuntimeError):
  """The unmutated copy cannot collect the selected tests."""


@dataclasses.dataclass
class Outcome:
  """What happened to one mutant."""

  id: str
  target: str
  file: str
  status: str
  seconds: float
  returncode: int | None = None
  summary: str = ""
  detail: str = ""


def stale_reason(mutation: catalogue.Mutation, root: pathlib.Path) -> str | None:
  """Why `mutation` cannot apply in `root` (its `old` text is not there exactly once), or None."""
  path = root / mutation.file
  if not path.is_file():
    return f"{mutation.file} does not exist"
  count = path.read_text().count(mutation.old)
  if count != 1:
    return f"`old` occurs {count} times in {mutation.file}"
  if mutation.old == mutation.new:
    return "`new` equals `old`"
  return None


def _tracked_files(root: pathlib.Path) -> list[str]:
  out = subprocess.run(
    ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
    cwd=root,
    check=True,
    capture_output=True,
  ).stdout
  return sorted({f for f in out.decode().split("\0") if f})


def make_copy(root: pathlib.Path, dest: pathlib.Path, source: str) -> None:
  """A copy of the repository at `dest`: the working tree's files, or HEAD."""
  dest.mkdir(parents=True)
  if source == "head":
    archive = subprocess.run(
      ["git", "archive", "--format=tar", "HEAD"], cwd=root, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return
  for name in _tracked_files(root):
    src = root / name
    target = dest / name
    if src.is_symlink():  # As a link (src/tokamax_harness -> ../harness), as git archive does.
      target.parent.mkdir(parents=True, exist_ok=True)
      target.symlink_to(os.readlink(src))
      continue
    if not src.is_file():
      continue  # Deleted in the working tree.
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, target)


def _pytest_command(selection: tuple[str, ...]) -> list[str]:
  # The verbosity is set last, so a selection's own -q cannot hide the summary line it is scored by.
  flags = ("-x", "-p", "no:cacheprovider")
  return [sys.executable, "-m", "pytest", *flags, *selection, "--verbosity=-1"]


def _environment(copy: pathlib.Path) -> dict[str, str]:
  env = dict(os.environ)
  env.update(
    JAX_PLATFORMS="cpu",
    PYTHONDONTWRITEBYTECODE="1",
    # The copy's sources, ahead of an editable install of the original.
    PYTHONPATH=os.pathsep.join([str(copy / "src"), str(copy)]),
  )
  return env


def _summary_line(output: str) -> str:
  for line in reversed(output.splitlines()):
    match = _SUMMARY.match(line.strip())
    if match:
      return match.group(1)
  return ""


def _collection_failed(output: str) -> bool:
  return bool(
    re.search(r"(errors? during collection|ERROR collecting|ImportError while importing)", output)
  )


def run_selection(
  copy: pathlib.Path, selection: tuple[str, ...], timeout: float
) -> tuple[str, int | None, str, str]:
  """(status, returncode, summary, tail of the output) of one pytest run in `copy`."""
  try:
    proc = subprocess.run(
      _pytest_command(selection),
      cwd=copy,
      env=_environment(copy),
      capture_output=True,
      text=True,
      timeout=timeout,
    )
  except subprocess.TimeoutExpired as e:
    out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    return TIMEOUT, None, f"over {timeout:g} s", out[-2000:]
  output = proc.stdout + proc.stderr
  summary = _summary_line(output)
  if proc.returncode == 0 and not re.search(r"\b\d+ passed\b", summary):
    # Everything skipped (or the summary is unreadable): the mutant was not exercised.
    status, summary = ERROR, f"no test passed; {summary or 'no summary line'}"
  elif proc.returncode == 0:
    status = SURVIVED
  elif proc.returncode == 1 and not _collection_failed(output):
    status = KILLED
  elif proc.returncode < 0 and not _collection_failed(output):
    # The tests crashed the interpreter (e.g. a kernel's out-of-bounds access in Triton's
    # interpreter): the selection failed.
    status, summary = KILLED, f"crashed by signal {-proc.returncode}; {summary}"
  else:  # 2: interrupted (collection errors), 3: internal, 4: usage, 5: nothing selected.
    status = ERROR
  return status, proc.returncode, summary, output[-2000:]


def _test_paths(selection: tuple[str, ...]) -> list[str]:
  """The files and node ids of a selection (its options and their values left out)."""
  paths, skip = [], False
  for arg in selection:
    if skip:
      skip = False
    elif arg in ("-k", "-m"):
      skip = True
    elif not arg.startswith("-"):
      paths.append(arg)
  return paths


def preflight(
  copy: pathlib.Path, mutations: list[catalogue.Mutation], timeout: float
) -> str | None:
  """Why the unmutated copy cannot collect the catalogue's tests, or None.

  A tree that does not even collect would make every mutant an ERROR.
  """
  paths = sorted({p for m in mutations for p in _test_paths(m.selection)})
  if not paths:
    return None
  try:
    proc = subprocess.run(
      [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *paths],
      cwd=copy,
      env=_environment(copy),
      capture_output=True,
      text=True,
      timeout=timeout,
    )
  except subprocess.TimeoutExpired:
    return f"collecting the selected tests took over {timeout:g} s"
  if proc.returncode != 0:
    return (proc.stdout + proc.stderr)[-3000:]
  return None


def _run_one(
  mutation: catalogue.Mutation, copy: pathlib.Path, timeout: float, baseline: bool
) -> Outcome:
  start = time.perf_counter()

  def outcome(status, returncode=None, summary="", detail=""):
    return Outcome(
      mutation.id,
      mutation.target,
      mutation.file,
      status,
      round(time.perf_counter() - start, 1),
      returncode,
      summary,
      detail,
    )

  reason = stale_reason(mutation, copy)
  if reason is not None:
    return outcome(STALE, detail=reason)
  if baseline:
    status, rc, summary, detail = run_selection(copy, mutation.selection, timeout)
    if status != SURVIVED:
      return outcome(BASELINE, rc, summary, f"unmutated selection: {status}\n{detail}")
  path = copy / mutation.file
  original = path.read_text()
  path.write_text(original.replace(mutation.old, mutation.new, 1))
  try:
    status, rc, summary, detail = run_selection(copy, mutation.selection, timeout)
  finally:
    path.write_text(original)
  return outcome(status, rc, summary, detail if status != KILLED else "")


def run(
  mutations: list[catalogue.Mutation],
  *,
  jobs: int = 2,
  timeout: float = 600.0,
  source: str = "worktree",
  baseline: bool = False,
  workdir: pathlib.Path | None = None,
  keep: bool = False,
  progress=print,
) -> list[Outcome]:
  """Runs `mutations` on `jobs` workers; returns their outcomes in catalogue order."""
  base = pathlib.Path(tempfile.mkdtemp(prefix="mutants-", dir=workdir))
  try:
    copies = []
    for i in range(max(1, min(jobs, len(mutations)))):
      copy = base / f"w{i}"
      if i == 0:
        make_copy(ROOT, copy, source)
      else:
        shutil.copytree(copies[0], copy, symlinks=True)
      copies.append(copy)
    # Stale mutations are reported before anything runs.
    stale = {m.id: stale_reason(m, copies[0]) for m in mutations}
    outcomes: dict[str, Outcome] = {
      m.id: Outcome(m.id, m.target, m.file, STALE, 0.0, detail=stale[m.id])
      for m in mutations
      if stale[m.id] is not None
    }
    for o in outcomes.values():
      progress(f"{o.id}: STALE ({o.detail})")
    todo = [m for m in mutations if m.id not in outcomes]
    broken = preflight(copies[0], todo, timeout)
    if broken is not None:
      raise PreflightError(f"the unmutated tree does not collect the selected tests:\n{broken}")
    free: queue.Queue[pathlib.Path] = queue.Queue()
    for c in copies:
      free.put(c)
    lock = threading.Lock()

    def work(mutation):
      copy = free.get()
      try:
        o = _run_one(mutation, copy, timeout, baseline)
      finally:
        free.put(copy)
      with lock:
        progress(f"{o.id}: {o.status} in {o.seconds:g} s ({o.summary})")
      return o

    with concurrent.futures.ThreadPoolExecutor(len(copies)) as pool:
      for o in pool.map(work, todo):
        outcomes[o.id] = o
    return [outcomes[m.id] for m in mutations]
  finally:
    if not keep:
      shutil.rmtree(base, ignore_errors=True)


def kill_rate(outcomes: list[Outcome]) -> float:
  """Killed over killed + survived (stale, errors and timeouts are reported apart)."""
  decided = [o for o in outcomes if o.status in (KILLED, SURVIVED)]
  return sum(o.status == KILLED for o in decided) / len(decided) if decided else 0.0


def table(outcomes: list[Outcome]) -> str:
  """A plain-text table: id, target, status, seconds; then the counts and the kill rate."""
  width = max([len(o.id) for o in outcomes] + [2])
  twidth = max([len(o.target) for o in outcomes] + [6])
  lines = [f"{'id':<{width}}  {'target':<{twidth}}  {'status':<8}  {'seconds':>7}"]
  lines += [
    f"{o.id:<{width}}  {o.target:<{twidth}}  {o.status:<8}  {o.seconds:>7.1f}" for o in outcomes
  ]
  counts = {s: sum(o.status == s for o in outcomes) for s in (KILLED, SURVIVED, ERROR, TIMEOUT)}
  counts |= {s: sum(o.status == s for o in outcomes) for s in (STALE, BASELINE)}
  lines.append(", ".join(f"{k.lower()} {v}" for k, v in counts.items() if v or k == SURVIVED))
  decided = counts[KILLED] + counts[SURVIVED]
  lines.append(
    f"kill rate {100.0 * kill_rate(outcomes):.1f}% of {decided} decided ({len(outcomes)} mutants)"
  )
  return "\n".join(lines)


def select(only: str | None) -> list[catalogue.Mutation]:
  """The catalogue, or the mutations named in `only` (ids or targets, comma-separated)."""
  mutations = list(catalogue.by_id().values())
  if not only:
    return mutations
  wanted = [w.strip() for w in only.split(",") if w.strip()]
  unknown = [w for w in wanted if not any(w in (m.id, m.target) for m in mutations)]
  if unknown:
    raise SystemExit(f"unknown mutation ids or targets: {', '.join(unknown)}")
  return [m for m in mutations if m.id in wanted or m.target in wanted]


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m ci.mutants", description=__doc__.split("\n")[0])
  parser.add_argument("--jobs", type=int, default=2, help="parallel workers (default 2)")
  parser.add_argument("--only", help="comma-separated mutation ids or targets")
  parser.add_argument("--list", action="store_true", help="list the catalogue and exit")
  parser.add_argument("--out", type=pathlib.Path, help="write a JSON summary here")
  parser.add_argument("--timeout", type=float, default=600.0, help="seconds per pytest run")
  parser.add_argument(
    "--source",
    choices=("worktree", "head"),
    default="worktree",
    help="copy the working tree's files (default) or HEAD",
  )
  parser.add_argument(
    "--baseline", action="store_true", help="run each selection unmutated first; it must pass"
  )
  parser.add_argument("--workdir", type=pathlib.Path, help="where the copies go (default: tmp)")
  parser.add_argument("--keep", action="store_true", help="keep the copies")
  args = parser.parse_args(argv)
  mutations = select(args.only)
  if args.list:
    for m in mutations:
      stale = stale_reason(m, ROOT)
      print(f"{m.id}  [{m.file}]{'  STALE: ' + stale if stale else ''}")
      print(f"    {m.description}")
      print(f"    pytest {' '.join(m.selection)}")
    return 0
  start = time.perf_counter()
  try:
    outcomes = run(
      mutations,
      jobs=args.jobs,
      timeout=args.timeout,
      source=args.source,
      baseline=args.baseline,
      workdir=args.workdir,
      keep=args.keep,
    )
  except PreflightError as e:
    print(f"ERROR: {e}", file=sys.stderr)
    return 2
  elapsed = time.perf_counter() - start
  print(table(outcomes))
  print(f"wall time {elapsed:.0f} s on {args.jobs} workers")
  for o in outcomes:
    if o.status not in (KILLED, SURVIVED):
      print(f"\n--- {o.id}: {o.status}\n{o.detail.strip()}")
  if args.out:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {
      "kill_rate": kill_rate(outcomes),
      "wall_seconds": round(elapsed, 1),
      "jobs": args.jobs,
      "source": args.source,
      "outcomes": [dataclasses.asdict(o) for o in outcomes],
    }
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
  return 0 if all(o.status == KILLED for o in outcomes) else 1
