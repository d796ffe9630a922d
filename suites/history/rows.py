"""A benchmark-history row for the history tests: one layer_norm measurement on a CPU."""


def history_row(
  ms: float = 1.0,
  run_id: str = "now@2026",
  date: str = "2026-12-02T00:00:00+00:00",
  shapes: dict | None = None,
  **fields,
) -> dict:
  """A row of `bench.history` with median `ms`; `fields` override or add any others."""
  shapes = {"n": 8} if shapes is None else shapes
  row = {
    "run_id": run_id,
    "commit": run_id.split("@")[0],
    "date": date,
    "device_kind": "cpu",
    "host": "test host x2",
    "device_time_method": "wallclock",
    "op": "layer_norm",
    "implementation": "xla",
    "case": "plain",
    "shape_key": ",".join(f"{k}={v}" for k, v in sorted(shapes.items())),
    "shapes": shapes,
    "dtype": "float32",
    "mode": "fwd",
    "device_time_median_ms": ms,
    "drift_ratio": 0.1,
    "drift_ok": True,
  }
  row.update(fields)
  return row
