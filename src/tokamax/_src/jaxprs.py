"""Walking jaxprs."""

from collections.abc import Iterator

from jax.extend import core as jex_core


def equations(jaxpr: jex_core.Jaxpr) -> Iterator[jex_core.JaxprEqn]:
  """Every equation of `jaxpr` and of the jaxprs nested in its equations' parameters."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, tuple | list) else (param,):
        if isinstance(sub, jex_core.ClosedJaxpr):
          yield from equations(sub.jaxpr)
        elif isinstance(sub, jex_core.Jaxpr):
          yield from equations(sub)
