"""The project's import graph: no cycles, and the harness (`tokamax_harness`) stands on third
parties alone (tokamax's CUPTI timer is an optional import)."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Top-level packages of the project and their folders (the harness's import name is not its
# folder's: harness/ installs as tokamax_harness).
PACKAGES = {
  "tokamax": ROOT / "src" / "tokamax",
  "tokamax_harness": ROOT / "harness",
  "suites": ROOT / "suites",
  "golden": ROOT / "golden",
  "bench": ROOT / "bench",
  "ci": ROOT / "ci",
}
# What the installable harness may import from the project.
HARNESS_MAY_IMPORT = ("tokamax_harness", "tokamax")


def _modules() -> dict[str, pathlib.Path]:
  """Project module name -> its file (packages by their __init__.py)."""
  out = {}
  for top, folder in PACKAGES.items():
    for path in sorted(folder.rglob("*.py")):
      parts = (top, *path.relative_to(folder).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      out[".".join(parts)] = path
  return out


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
  """The project modules `name` imports, at module level or inside functions."""
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = package.split(".")
        base = base[: len(base) - node.level + 1]
        source = ".".join([*base, node.module] if node.module else base)
      else:
        source = node.module
      for alias in node.names:  # `from pkg import submodule` imports the submodule.
        sub = f"{source}.{alias.name}"
        found.add(sub if sub in modules else source)
  return {m for m in found if m in modules and m != name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
  modules = _modules()
  return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """One cycle per strongly connected component of more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_the_walker_sees_a_planted_cycle():
  planted = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
  assert _cycles(planted) == [["a", "b", "c"]]
  assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_walker_reads_lazy_and_relative_imports(tmp_path):
  source = "import x\nfrom . import y\ndef f():\n  from .z import q\n"
  path = tmp_path / "m.py"
  path.write_text(source)
  modules = {"p.m": path, "x": path, "p.y": path, "p.z": path, "p": path}
  assert _imports("p.m", path, modules) == {"x", "p.y", "p.z"}


def test_no_import_cycles(graph):
  assert not _cycles(graph), f"import cycles: {_cycles(graph)}"


def test_harness_imports_only_itself_and_optionally_tokamax(graph):
  # harness/tests is not installed (harness/pyproject.toml leaves it out): it checks the suites.
  bad = {
    (name, target)
    for name, targets in graph.items()
    if name.split(".")[0] == "tokamax_harness" and not name.startswith("tokamax_harness.tests")
    for target in targets
    if target.split(".")[0] not in HARNESS_MAY_IMPORT
  }
  assert not bad, f"harness imports outside tokamax: {sorted(bad)}"
