"""What the GPU scripts in ci/gpu share: a results document saved as JSON, a timed log,
and guarded steps whose errors are recorded (and the run goes on) rather than fatal."""

import functools
import json
import time
import traceback
from collections.abc import Callable
from typing import Any

from harness import grads


class Record:
  """The results of one script run.

  Attributes:
    path: Where `save` writes the JSON (scripts set it from their --out).
    results: The document: device, commit, errors, and the script's own fields.
  """

  def __init__(self, path: str, **fields: Any):
    self.path = path
    self.results: dict[str, Any] = {"device": None, "commit": None, **fields, "errors": []}
    self._start = time.monotonic()

  def save(self) -> None:
    with open(self.path, "w") as f:
      json.dump(self.results, f, indent=1, default=str)

  def log(self, *parts: Any) -> None:
    print(f"[{time.monotonic() - self._start:6.1f}s]", *parts, flush=True)

  def guarded(self, fn: Callable) -> Callable:
    """`fn`, with an exception recorded under "errors" and None returned."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
      try:
        return fn(*args, **kwargs)
      except Exception as e:
        traceback.print_exc()
        error = {
          "where": f"{fn.__name__}{args}{kwargs}",
          "error": f"{type(e).__name__}: {e}"[:3000],
        }
        self.log("ERROR", error["where"], error["error"][:300])
        self.results["errors"].append(error)
        self.save()
        return None

    return wrapped


def forward_backward(fn: Callable, diff_argnums: tuple[int, ...]) -> Callable:
  """`(*args, cotangent) -> (out, grads)`: a training step's view of `fn`.

  The forward output stays live and the cotangent takes the output's dtype
  (`harness.grads.vjp`); grads are with respect to `diff_argnums`.
  """

  def step(*args_and_cotangent):
    *args, cotangent = args_and_cotangent

    def of_diff(*diff):
      full = list(args)
      for i, value in zip(diff_argnums, diff, strict=True):
        full[i] = value
      return fn(*full)

    return grads.vjp(of_diff, tuple(args[i] for i in diff_argnums), cotangent)

  return step
