"""The exercise pipeline: generator rules, and the shipped notebooks behave as promised."""

import re
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from gpucourse.grading.selfcheck import run_notebook
from gpucourse.grading.exercises import (BEGIN, END, ExerciseFormatError, exercise_index,
                                 generate_exercises, make_exercise_notebook, strip_solutions)

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("[0-9][0-9]_*.ipynb"))


def _check(source, **kw):
    return new_code_cell(source, metadata={"tags": ["check"]}, **kw)


def _tiny_solutions_notebook():
    return new_notebook(cells=[
        new_markdown_cell("# Chapter 99\n## Exercise 99.1 — double"),
        new_code_cell(f"def double(x):\n    {BEGIN}\n    return 2 * x\n    {END}",
                      outputs=[new_output("stream", name="stdout", text="secret")]),
        _check("# Check 99.1 — double\nassert double(21) == 42\nprint('ok')",
               outputs=[new_output("stream", name="stdout", text="ok\n")]),
        new_code_cell("print('instructor only')", metadata={"tags": ["solution-only"]}),
    ])


# --- generator unit tests ----------------------------------------------------------------------

def test_strip_keeps_indentation_and_code_around_regions():
    src = ("def f(x):\n    y = x + 1\n    ### BEGIN SOLUTION\n    return y * 2\n    ### END SOLUTION\n"
           "\nclass A:\n    def g(self):\n        ### BEGIN SOLUTION\n        return 1\n"
           "        ### END SOLUTION")
    out = strip_solutions(src, "42.7")
    assert "return y * 2" not in out and "return 1" not in out
    assert out.count('raise NotImplementedError("Exercise 42.7') == 2
    assert "    y = x + 1\n    # YOUR CODE HERE\n    raise" in out
    assert "        # YOUR CODE HERE\n        raise" in out
    compile(out, "<stub>", "exec")


@pytest.mark.parametrize("src, msg", [
    (f"{BEGIN}\nx = 1", "never closed"),
    (f"x = 1\n{END}", "without"),
    (f"{BEGIN}\n{BEGIN}\n{END}", "inside another region"),
])
def test_strip_rejects_unbalanced_markers(src, msg):
    with pytest.raises(ExerciseFormatError, match=msg):
        strip_solutions(src, "00.1")


def test_make_exercise_notebook_strips_clears_and_keeps_checks():
    nb = _tiny_solutions_notebook()
    ex = make_exercise_notebook(nb, name="99_tiny_exercises.ipynb")
    assert len(ex.cells) == 3                                         # solution-only dropped
    assert "return 2 * x" not in ex.cells[1].source and ex.cells[1].outputs == []
    assert ex.cells[2].source == nb.cells[2].source                   # check kept ...
    assert ex.cells[2].outputs == [] and ex.cells[2].execution_count is None   # ... but not run
    assert ex.cells[2].metadata["gpucourse"]["exercise"] == "99.1"
    assert ex.metadata["gpucourse"]["chapter"] == "99"
    assert nb.cells[1].source.count("return 2 * x") == 1               # input untouched


@pytest.mark.parametrize("mutate, msg", [
    (lambda nb: nb.cells.pop(2), "exactly one check cell"),
    (lambda nb: nb.cells[1].update(source="def double(x):\n    return 2 * x"), "no '### BEGIN"),
    (lambda nb: nb.cells[2].update(source="assert double(1) == 2"), "must start with '# Check"),
    (lambda nb: nb.cells[2].update(source="# Check 99.2 — x\nassert 1"), "check cell for 99.2"),
    (lambda nb: nb.cells[2].metadata.update(tags=[]), "not tagged 'check'"),
    (lambda nb: nb.cells.insert(0, new_code_cell(f"def f():\n    {BEGIN}\n    pass\n    {END}")),
     "before any"),
])
def test_exercise_conventions_are_enforced(mutate, msg):
    nb = _tiny_solutions_notebook()
    mutate(nb)
    with pytest.raises(ExerciseFormatError, match=re.escape(msg)):
        exercise_index(nb)


def test_generate_writes_checks_and_removes_stale(tmp_path):
    sol, ex = tmp_path / "solutions", tmp_path / "exercises"
    sol.mkdir()
    nbformat.write(_tiny_solutions_notebook(), sol / "99_tiny_exercises.ipynb")
    ex.mkdir()
    (ex / "98_gone_exercises.ipynb").write_text("{}")
    assert len(generate_exercises(sol, ex, check_only=True)) == 2
    generate_exercises(sol, ex)
    assert [p.name for p in ex.iterdir()] == ["99_tiny_exercises.ipynb"]
    assert generate_exercises(sol, ex, check_only=True) == []


# --- the shipped course ------------------------------------------------------------------------

#: chapters allowed fewer than 4 exercises, and their minimum: 00 is setup; 11 is new and has 3
#: so far (issue 15's rule was written for 00-10) — raise it when it gets its fourth
FEWER_EXERCISES = {"00": 3}


def test_every_chapter_has_enough_exercises():
    """Issue 15: every chapter has at least 4 exercises (chapter 00, setup, at least 3)."""
    assert SOLUTIONS, "no solutions notebooks"
    for path in SOLUTIONS:
        index = exercise_index(nbformat.read(path, as_version=4), name=path.name)
        minimum = FEWER_EXERCISES.get(path.name[:2], 4)
        assert len(index) >= minimum, f"{path.name}: {len(index)} exercises"


def test_exercises_are_up_to_date_with_solutions():
    stale = generate_exercises(ROOT / "solutions", ROOT / "exercises", check_only=True)
    assert stale == [], f"run `make exercises`: {[p.name for p in stale]} are out of date"


def _error(cell):
    return next((o for o in cell.get("outputs", []) if o.output_type == "error"), None)


def _is_not_implemented(err):
    return err is not None and (err.ename == "NotImplementedError" or (
        err.ename == "WorkerError" and "NotImplementedError" in err.evalue))


@pytest.mark.parametrize("path", EXERCISES, ids=[p.name for p in EXERCISES])
def test_shipped_exercises_fail_exactly_at_check_cells(path):
    nb, fatal = run_notebook(path, cell_timeout=240)
    assert not fatal, fatal
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        err = _error(cell)
        if "check" in cell.metadata.get("tags", []):
            assert _is_not_implemented(err), (
                f"{path.name} cell {index}: check cell should fail with NotImplementedError, "
                f"got {err.ename + ': ' + err.evalue if err else 'no error'}")
        else:
            assert err is None, f"{path.name} cell {index} raised {err.ename}: {err.evalue}"


TRIVIAL = {"none": "return None", "zero": "return 0"}


@pytest.mark.parametrize("answer", sorted(TRIVIAL))
@pytest.mark.parametrize("path", SOLUTIONS, ids=[p.name for p in SOLUTIONS])
def test_trivial_answers_fail_every_check(path, answer, tmp_path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code" and BEGIN in cell.source:
            stub = strip_solutions(cell.source, "xx.x")
            cell.source = stub.replace('raise NotImplementedError("Exercise xx.x: replace this line '
                                       'with your code")', TRIVIAL[answer])
    variant = tmp_path / path.name
    nbformat.write(nb, variant)
    executed, fatal = run_notebook(variant, cell_timeout=240)
    assert not fatal, fatal
    for index, cell in enumerate(executed.cells):
        if "check" in cell.metadata.get("tags", []):
            assert _error(cell) is not None, (
                f"{path.name} cell {index}: the check passed with `{TRIVIAL[answer]}` as the answer")
