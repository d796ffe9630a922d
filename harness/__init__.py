"""tokamax's test harness (import `tokamax_harness`): a library and a pytest plugin (`-p tokamax_harness`).

Modules: `hardware` (the profile of the accelerator), `tolerance` (the one
tolerance policy), `compare` (comparators), `references` (independent jnp
references of every op, and running them at high precision),
`grads` (gradient checks), `timing` (device time), `bench` (benchmark records).
"""

from .plugin import (
  hardware_fixture as hardware_fixture,
)
from .plugin import (
  interpret as interpret,
)
from .plugin import (
  pytest_addoption as pytest_addoption,
)
from .plugin import (
  pytest_collection_modifyitems as pytest_collection_modifyitems,
)
from .plugin import (
  pytest_configure as pytest_configure,
)
from .plugin import (
  pytest_report_header as pytest_report_header,
)
from .plugin import (
  pytest_runtest_setup as pytest_runtest_setup,
)
from .plugin import (
  rng_key as rng_key,
)
