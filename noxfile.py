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


def _project_python(session) -> tuple[str, str]:
  """The interpreter of the sessions that install nothing ($TOKAMAX_PYTHON, else the README's
  .venv, else `python`) and its jax backend; one line and a stop if it cannot import jax."""
  python = os.environ.get("TOKAMAX_PYTHON") or (
    ".venv/bin/python" if os.path.exists(".venv/bin/python") else "python"
  )
  probe = "import jax; print('backend', jax.default_backend())"
  out = session.run(python, "-c", probe, silent=True, success_codes=range(256), external=True)
  lines = [line for line in str(out).splitlines() if line.startswith("backend ")]
  if not lines:
    session.error(
      f"{session.name} needs the project's environment ({python} cannot import jax): run "
      "`python3.12 -m venv .venv && .venv/bin/pip install -e '.[test,triton]' -e ./harness` "
      "first, or set TOKAMAX_PYTHON to an interpreter that has it"
    )
  return python, lines[-1].split()[1]


def _run_module(session, module: str, *args):
  python, _ = _project_python(session)
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
  python, backend = _project_python(session)
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
  python, backend = _project_python(session)
  on_tpu = backend == "tpu"
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
