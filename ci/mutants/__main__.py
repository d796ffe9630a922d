"""`python -m ci.mutants`: runs the mutation catalogue (see `ci.mutants.runner`)."""

import sys

from ci.mutants import runner

if __name__ == "__main__":
  sys.exit(runner.main())
