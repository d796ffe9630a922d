"""Mutation testing of the suites: planted bugs (`catalogue`) run by `runner`.

  python -m ci.mutants --list            # the catalogue, with stale entries flagged
  python -m ci.mutants [--jobs 2]        # every mutant; exit 1 unless all are killed
  python -m ci.mutants --only harness,dispatch.fallback_zeros --out mutants.json
  nox -s mutants [-- --only ID]

Each mutation names the few tests that should catch it, so the whole
catalogue runs in minutes on two cores (see the report of the last full run
in the commit that last changed this docstring). A new bug class that escaped the suites belongs here
as a mutation, together with the test that kills it.
"""
