"""nox sessions: `nox -l` lists them; arguments after `--` go to pytest.

Accelerator sessions (`gpu_tests`, `tpu_tests`, `bench`, `golden`) run in the
environment that is already there (accelerator hosts are often offline): no
virtualenv, no installs. `tests` and `lint` build their own environment.
"""

import glob
import os

import nox

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"

PYTHON = "3.12"
TEST_EXTRAS = ".[test,triton]"
# Run artefacts (summaries, benchmark JSON) go here; the default is ignored by git.
RESULTS = os.environ.get("TOKAMAX_RESULTS_DIR", "bench/out")


def _pytest(session, *args):
  session.run("python", "-m", "pytest", *args, *session.posargs, env={"PYTHONPATH": "src:."})


def _project_python(session) -> str:
  """The interpreter of the sessions that install nothing: $TOKAMAX_PYTHON, else the README's
  .venv, else `python`; the session stops with one line if it cannot import jax."""
  python = os.environ.get("TOKAMAX_PYTHON") or (
    ".venv/bin/python" if os.path.exists(".venv/bin/python") else "python"
  )
  probe = session.run(
    python, "-c", "import jax", silent=True, success_codes=range(256), external=True
  )
  if probe is None or "Error" in str(probe):
    session.error(
      f"{session.name} needs the project's environment ({python} cannot import jax): run "
      "`python3.12 -m venv .venv && .venv/bin/pip install -e '.[test,triton]'` first, or set "
      "TOKAMAX_PYTHON to an interpreter that has it"
    )
  return python


def _run_module(session, module: str, *args):
  python = _project_python(session)
  session.run(python, "-m", module, *args, env={"PYTHONPATH": "src:."}, external=True)


@nox.session(python=PYTHON)
def tests(session):
  """Everything that runs on a CPU machine: harness, core, kernels (interpret/compile), the CPU matrix."""
  session.install("-e", TEST_EXTRAS, "-e", "./harness")
  _pytest(session, "-q")


@nox.session(venv_backend="none")
def gpu_tests(session):
  """The GPU suite for the GPU found (h100 or a100 matrix), through ci/gpu_suite.sh, in the current environment.

  pytest-xdist workers sized to the host and one set of compile caches (see ci/gpu_suite.sh for
  SUITE_WORKERS, TOKAMAX_COMPILATION_CACHE, ...); summary, JUnit and log in RESULTS/gpu_run.
  """
  python = _project_python(session)
  probe = "import jax; print(jax.default_backend())"
  found = session.run(python, "-c", probe, silent=True, success_codes=range(256), external=True)
  backend = str(found).strip().splitlines()[-1] if str(found).strip() else "nothing"
  if backend != "gpu":
    session.error(
      f"no GPU here (jax.default_backend(): {backend!r}). gpu_tests needs an NVIDIA GPU and "
      "jax with CUDA; on a CPU host run `nox -s tests`"
    )
  session.run(
    "bash",
    "ci/gpu_suite.sh",
    *session.posargs,
    env={
      "PATH": f"{os.path.dirname(os.path.abspath(python))}:{os.environ.get('PATH', '')}",
      "OUT": f"{RESULTS}/gpu_run",
      "SKIP_BENCH": "1",  # `nox -s bench` times them.
      "SUITE_TIMEOUT": os.environ.get("SUITE_TIMEOUT", "0"),  # 0: no time limit.
    },
    external=True,
  )


@nox.session(venv_backend="none")
def tpu_tests(session):
  """The TPU suite (tpu_v5 matrix) on a TPU host; elsewhere the TPU kernels in their interpreter."""
  python = _project_python(session)
  probe = "import jax; print(jax.default_backend())"
  found = session.run(python, "-c", probe, silent=True, external=True)
  on_tpu = str(found).strip().splitlines()[-1] == "tpu"
  paths = [] if on_tpu else sorted(glob.glob("suites/kernels/test_tpu_*.py"))
  if not on_tpu:
    session.log("no TPU here: the TPU kernels in Pallas's TPU interpreter and exported for TPU")
  session.run(
    python,
    "-m",
    "pytest",
    "-q",
    f"--summary-json={RESULTS}/tpu_summary.json",
    f"--summary-md={RESULTS}/tpu_summary.md",
    *paths,
    *session.posargs,
    env={"PYTHONPATH": "src:."},
    external=True,
  )


@nox.session(venv_backend="none")
def bench(session):
  """Times the op database's benchmark cases once and checks them against the history.

  Records go to the ignored bench/out/history.jsonl; arguments after `--` go to
  `python -m bench.history run` (`--check`, `--append-tracked` for the nightly).
  """
  _run_module(session, "bench.history", "run", *session.posargs)


@nox.session(venv_backend="none")
def golden(session):
  """Golden-value regression checks (`-- --regen` regenerates them)."""
  _run_module(session, "golden", *session.posargs)


@nox.session(python=PYTHON)
def lint(session):
  """ruff check and ruff format --check."""
  session.install("ruff==0.17.6")
  session.run("ruff", "check", ".")
  session.run("ruff", "format", "--check", ".")


@nox.session(venv_backend="none")
def mutants(session):
  """Mutation testing: each planted bug of ci/mutants/catalogue.py must fail its tests (`-- --only ID`)."""
  _run_module(session, "ci.mutants", f"--out={RESULTS}/mutants.json", *session.posargs)
