"""The bound on a kernel run in Triton's interpreter against its float64 reference."""


def assert_errors_within_bound(result: dict) -> None:
  """Fails unless every relative error in `result["errors"]` is within the dtype's bound.

  The interpreter computes in the input dtype with float32 accumulation: float32 inputs
  stay within 1e-5 of the reference, 16-bit inputs within 2e-3.
  """
  bound = 1e-5 if result["dtype"] == "float32" else 2e-3
  assert all(e <= bound for e in result["errors"].values()), result
