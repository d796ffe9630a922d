"""tokamax's test harness: an importable library and a pytest plugin (`-p harness`).

Modules: `hardware` (the profile of the accelerator), `tolerance` (the one
tolerance policy), `compare` (comparators), `references` (independent jnp
references of every op, and running them at high precision),
`grads` (gradient checks), `timing` (device time), `bench` (benchmark records).
"""

from harness.plugin import (
  hardware_fixture as hardware_fixture,
)
from harness.plugin import (
  interpret as interpret,
)
from harness.plugin import (
  pytest_addoption as pytest_addoption,
)
from harness.plugin import (
  pytest_collection_modifyitems as pytest_collection_modifyitems,
)
from harness.plugin import (
  pytest_configure as pytest_configure,
)
from harness.plugin import (
  pytest_report_header as pytest_report_header,
)
from harness.plugin import (
  pytest_runtest_setup as pytest_runtest_setup,
)
from harness.plugin import (
  rng_key as rng_key,
)
