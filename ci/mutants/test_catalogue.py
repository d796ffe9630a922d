"""The catalogue applies to the tree as it is, and the runner classifies outcomes.

Run with `python -m pytest ci/mutants/test_catalogue.py` (not in the default
testpaths: it runs no mutant).
"""

import dataclasses
import pathlib
import subprocess

import pytest

from ci.mutants import catalogue, runner


@pytest.mark.parametrize("mutation", catalogue.MUTATIONS, ids=lambda m: m.id)
def test_mutation_applies_exactly_once(mutation):
  assert runner.stale_reason(mutation, runner.ROOT) is None
  assert mutation.selection and mutation.description
  # A bare string would run pytest on its characters, one argument each.
  assert isinstance(mutation.selection, tuple), mutation.selection
  assert all(isinstance(arg, str) for arg in mutation.selection), mutation.selection


def test_ids_are_unique():
  assert len(catalogue.by_id()) == len(catalogue.MUTATIONS)


def test_stale_reasons(tmp_path: pathlib.Path):
  (tmp_path / "f.py").write_text("a = 1\na = 1\nb = 2\n")
  m = catalogue.Mutation("t.x", "f.py", "b = 2", "b = 3", ("x",), "")
  assert runner.stale_reason(m, tmp_path) is None
  assert "2 times" in runner.stale_reason(dataclasses.replace(m, old="a = 1"), tmp_path)
  assert "0 times" in runner.stale_reason(dataclasses.replace(m, old="c = 1"), tmp_path)
  assert "does not exist" in runner.stale_reason(dataclasses.replace(m, file="g.py"), tmp_path)


def test_select_by_id_and_target():
  first = catalogue.MUTATIONS[0]
  assert runner.select(first.id) == [first]
  assert all(m.target == "harness" for m in runner.select("harness"))
  with pytest.raises(SystemExit):
    runner.select("no.such.mutation")


def test_kill_rate_and_table():
  outcomes = [
    runner.Outcome("a.x", "a", "f", runner.KILLED, 1.0),
    runner.Outcome("a.y", "a", "f", runner.SURVIVED, 2.0),
    runner.Outcome("b.z", "b", "f", runner.STALE, 0.0),
  ]
  assert runner.kill_rate(outcomes) == 0.5
  text = runner.table(outcomes)
  assert "kill rate 50.0% of 2 decided" in text and "stale 1" in text and "SURVIVED" in text


def test_runs_a_selection_and_classifies(tmp_path: pathlib.Path):
  (tmp_path / "test_it.py").write_text("def test_ok():\n  assert 1 + 1 == 2\n")
  assert runner.run_selection(tmp_path, ("test_it.py",), 120)[0] == runner.SURVIVED
  # A selection's own -q (pytest's -qq prints no summary line) still scores the run.
  assert runner.run_selection(tmp_path, ("-q", "test_it.py"), 120)[0] == runner.SURVIVED
  (tmp_path / "test_it.py").write_text("def test_ok():\n  assert 1 + 1 == 3\n")
  assert runner.run_selection(tmp_path, ("test_it.py",), 120)[0] == runner.KILLED
  (tmp_path / "test_it.py").write_text("import no_such_module\n")
  assert runner.run_selection(tmp_path, ("test_it.py",), 120)[0] == runner.ERROR
  (tmp_path / "test_it.py").write_text("def test_ok():\n  pass\n")
  assert runner.run_selection(tmp_path, ("test_it.py", "-k", "nothing"), 120)[0] == runner.ERROR
  # Every test skipped: the mutant was never exercised, so neither a kill nor a survival.
  (tmp_path / "test_it.py").write_text(
    "import pytest\n\n\n@pytest.mark.skip\ndef test_ok():\n  pass\n"
  )
  assert runner.run_selection(tmp_path, ("test_it.py",), 120)[0] == runner.ERROR


def test_preflight_stops_a_tree_that_does_not_collect(tmp_path: pathlib.Path):
  m = catalogue.Mutation("t.x", "f.py", "a", "b", ("test_it.py", "-k", "ok"), "")
  (tmp_path / "test_it.py").write_text("def test_ok():\n  pass\n")
  assert runner.preflight(tmp_path, [m], 120) is None
  (tmp_path / "test_it.py").write_text("def test_ok(:\n")
  assert "SyntaxError" in runner.preflight(tmp_path, [m], 120)


def test_run_mutates_a_copy_and_reports_in_catalogue_order(tmp_path, monkeypatch):
  root = tmp_path / "repo"
  root.mkdir()
  subprocess.run(["git", "init", "-q"], cwd=root, check=True)
  (root / "f.py").write_text("X = 1\nY = 2\n")
  (root / "test_f.py").write_text("import f\n\n\ndef test_x():\n  assert f.X == 1\n")
  monkeypatch.setattr(runner, "ROOT", root)
  m = catalogue.Mutation("t.x", "f.py", "X = 1", "X = 3", ("test_f.py",), "")
  mutations = [
    dataclasses.replace(m, id="t.survives", old="Y = 2", new="Y = 5"),
    m,
    dataclasses.replace(m, id="t.stale", old="Z = 1"),
  ]
  work = tmp_path / "work"
  work.mkdir()
  outcomes = runner.run(mutations, jobs=1, workdir=work, keep=True, progress=lambda _: None)
  assert [(o.id, o.status) for o in outcomes] == [
    ("t.survives", runner.SURVIVED),
    ("t.x", runner.KILLED),
    ("t.stale", runner.STALE),
  ]
  assert "1 passed" in outcomes[0].summary and "1 failed" in outcomes[1].summary
  # One copy for one job; the mutants were planted there, and undone; the original is untouched.
  (base,) = work.iterdir()
  assert sorted(c.name for c in base.iterdir()) == ["w0"]
  assert (base / "w0" / "f.py").read_text() == (root / "f.py").read_text() == "X = 1\nY = 2\n"


def test_help_describes_the_runner(capsys):
  with pytest.raises(SystemExit):
    runner.main(["--help"])
  assert "Runs the mutation catalogue" in capsys.readouterr().out


def test_copy_of_a_tree_git_does_not_know_fails(tmp_path):
  (tmp_path / "tree").mkdir()
  (tmp_path / "tree" / "f.py").write_text("X = 1\n")
  # Not an empty copy (whose every mutant would then be an ERROR of a missing file).
  with pytest.raises(subprocess.CalledProcessError):
    runner.make_copy(tmp_path / "tree", tmp_path / "copy", "worktree")
