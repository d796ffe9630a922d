"""Tuning one op call: compile every candidate config in parallel, time each.

Candidates come from the implementation's `_get_autotuning_configs`. They are
lowered and compiled on a thread pool (XLA compiles without the GIL); one that
takes longer than `timeout_s` is abandoned and recorded as an error, as is one
that fails to lower, compile or run. The compiled candidates then run one after
the other on the device, timed by `benchmarking` (CUPTI kernel time on NVIDIA
GPUs, wall clock elsewhere); the fastest median wins.
"""

import concurrent.futures
import dataclasses
import sys
import time
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from tokamax._src import arguments, benchmarking
from tokamax._src.autotuning import configs, inputs

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_ITERATIONS = 5


@dataclasses.dataclass(frozen=True)
class AutotuningData:
  """The candidates of one op call and how they fared.

  Attributes:
    op: The op's name (`OpSpec.name`).
    implementation: The implementation's name.
    key: `arguments.signature_key` of the call.
    mode: What was timed: "forward" or "forward_and_vjp".
    config: Canonical JSON of the chosen (fastest) config; None if no
      candidate worked.
    timings_ms: (canonical config JSON, median ms) per candidate, fastest first.
    errors: (canonical config JSON, message) per candidate that failed (None
      for a failure of the whole op).
    config_cls: The class the configs decode to; None until known (a loaded
      result learns it at lookup, from the op).
    heuristic: Canonical JSON of the heuristics' config when the candidates
      were timed; None if not recorded. A shipped entry whose heuristic is no
      longer the current one predates the measurements behind the current
      heuristics, and is not used.
  """

  op: str
  implementation: str
  key: str
  mode: str
  config: str | None
  timings_ms: tuple[tuple[str, float], ...] = ()
  errors: tuple[tuple[str | None, str], ...] = ()
  config_cls: type | None = dataclasses.field(default=None, compare=False, repr=False)
  heuristic: str | None = None

  @property
  def fastest_config(self) -> Any:
    """The chosen config (a dict if the config class is not known yet)."""
    text = self.config
    if text is None:
      return None
    if self.config_cls is None:
      import json

      return json.loads(text)
    return configs.decode(self.config_cls, text)


class Progress:
  """A one-line progress bar on stderr."""

  def __init__(self, enabled: bool, total: int, label: str = "tokamax.autotune"):
    self.enabled = enabled
    self.total = max(total, 1)
    self.label = label
    self.done = 0
    self.start = time.monotonic()

  def update(self, note: str, advance: int = 0) -> None:
    self.done += advance
    if not self.enabled:
      return
    width = 20
    filled = int(width * self.done / self.total)
    bar = "#" * filled + "-" * (width - filled)
    elapsed = time.monotonic() - self.start
    line = f"[{self.label}] [{bar}] {self.done}/{self.total} {elapsed:6.1f}s {note}"
    end = "\n" if not sys.stderr.isatty() or self.done >= self.total else ""
    sys.stderr.write(("\r" if sys.stderr.isatty() else "") + line[:160].ljust(80) + end)
    sys.stderr.flush()


def _short_error(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0] if text else ''}"[:500]


def _compile_all(
  candidates: list[tuple[Any, Any]], timeout_s: float, max_workers: int | None, progress: Progress
) -> tuple[dict[int, Any], dict[int, str]]:
  """Compiles `(fn, args)` pairs in parallel; returns executables and errors by index."""
  started: dict[int, float] = {}

  def work(i: int):
    started[i] = time.monotonic()
    fn, args = candidates[i]
    return jax.jit(fn).lower(args).compile()

  pool = concurrent.futures.ThreadPoolExecutor(
    max_workers=max_workers, thread_name_prefix="tokamax-autotune"
  )
  futures = {pool.submit(work, i): i for i in range(len(candidates))}
  compiled, errors = {}, {}
  pending = set(futures)
  try:
    while pending:
      done, pending = concurrent.futures.wait(
        pending, timeout=0.25, return_when=concurrent.futures.FIRST_COMPLETED
      )
      for future in done:
        i = futures[future]
        error = future.exception()
        if error is None:
          compiled[i] = future.result()
        else:
          errors[i] = _short_error(error)
        progress.update(f"compiled {len(compiled)}, failed {len(errors)}", advance=1)
      now = time.monotonic()
      for future in list(pending):
        i = futures[future]
        if i in started and now - started[i] > timeout_s:
          errors[i] = f"TimeoutError: compilation took longer than {timeout_s:g} s"
          pending.discard(future)
          progress.update(f"candidate {i} timed out", advance=1)
  finally:
    # Abandoned compilations finish in the background; their results are dropped.
    pool.shutdown(wait=False, cancel_futures=True)
  return compiled, errors


def concrete_record(record: Any, spec: Any, seed: int = 0) -> Any:
  """A record of random concrete arrays shaped like `record`, a record of `spec`."""
  record = inputs.fill_integer_fields(arguments.abstract(record), spec, seed)
  leaves, tree = jax.tree.flatten(record)
  return tree.unflatten(benchmarking.initialize(leaves, seed))


def autotune_call(
  op: Any,
  args: Any,
  *,
  mode: str = "forward",
  candidates: Iterable[Any] | None = None,
  timeout_s: float = DEFAULT_TIMEOUT_S,
  max_workers: int | None = None,
  iterations: int = DEFAULT_ITERATIONS,
  method: str | None = None,
  seed: int = 0,
  progress: bool = False,
) -> AutotuningData:
  """Times every candidate config of `op` on `args`.

  Args:
    op: The implementation (an `Op`).
    args: Its canonical record, concrete or abstract.
    mode: "forward" times the op alone, "forward_and_vjp" with its gradient.
    candidates: The configs to try; default the op's `_get_autotuning_configs`.
    timeout_s: Compile time allowed to one candidate.
    max_workers: Compile threads; default the pool's.
    iterations: Timed runs per candidate (the median counts).
    method: `benchmarking` timing method; None for the best available.
    seed: Seed of the random inputs.
    progress: Show a progress bar on stderr.

  Returns:
    The `AutotuningData`, candidates ordered fastest first.
  """
  if mode not in ("forward", "forward_and_vjp"):
    raise ValueError(f"`mode` must be 'forward' or 'forward_and_vjp', got {mode!r}.")
  # Tuning may start while a function is traced (a cache miss): run eagerly.
  with jax.ensure_compile_time_eval():
    return _autotune(
      op, args, mode, candidates, timeout_s, max_workers, iterations, method, seed, progress
    )


def _autotune(
  op, args, mode, candidates, timeout_s, max_workers, iterations, method, seed, progress
):
  op = op.with_config(None)
  abstract = arguments.abstract(args)
  if candidates is None:
    candidates = op._get_autotuning_configs(abstract)
  if mode == "forward":  # Backward-only variants of one forward program: time it once.
    candidates = {op._forward_config(abstract, c) for c in candidates}
  by_text = {configs.encode(c): c for c in candidates}
  texts = sorted(by_text)
  record = concrete_record(abstract, op.spec, seed)
  label = f"{op.spec.name}[{op.name}]"
  bar = Progress(progress, 2 * len(texts), label=f"autotune {label}")
  fns = [
    benchmarking.standardize_function(
      _Candidate(op.with_config(by_text[t])), record, mode=mode, seed=None
    )
    for t in texts
  ]
  compiled, failures = _compile_all(fns, timeout_s, max_workers, bar)
  errors = {texts[i]: message for i, message in failures.items()}
  timings = []
  for i, text in enumerate(texts):
    if i not in compiled:
      bar.update(f"skipped {text}", advance=1)
      continue
    try:
      times = benchmarking.time_compiled(
        compiled[i], fns[i][1], iterations=iterations, method=method
      )
      timings.append((text, float(np.median(times))))
    except Exception as e:
      errors[text] = _short_error(e)
    bar.update(f"timed {text}", advance=1)
  timings.sort(key=lambda item: (item[1], item[0]))
  return AutotuningData(
    op=op.spec.name,
    implementation=op.name,
    key=arguments.signature_key(abstract),
    mode=mode,
    config=timings[0][0] if timings else None,
    timings_ms=tuple(timings),
    errors=tuple(sorted(errors.items())),
    config_cls=op.config_cls,
    heuristic=configs.encode(op._get_heuristics_config(abstract)),
  )


@dataclasses.dataclass(frozen=True)
class _Candidate:
  """`op.apply` as a hashable callable (one per config)."""

  op: Any

  def __call__(self, record: Any) -> jax.Array:
    return self.op.apply(record)
