"""`python -m gpucourse check`: the learner's self-check, decided by the same judge as `grade`."""

import re
import subprocess
import sys

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from gpucourse.grading.exercises import BEGIN, END, make_exercise_notebook

NAME = "98_two_exercises.ipynb"


def _solutions():
    return new_notebook(cells=[
        new_code_cell("import gpucourse as gc"),
        new_markdown_cell("## Exercise 98.1 — square"),
        new_code_cell(f"def square(x):\n    {BEGIN}\n    return x * x\n    {END}"),
        new_code_cell("# Check 98.1 — square on random inputs\ndef cases(rng):\n"
                      "    return [(rng.randint(-99, 99),) for _ in range(20)]\n\n"
                      "gc.check_exercise('98.1', square, cases)", metadata={"tags": ["check"]}),
        new_code_cell("# Hidden 98.1 — large\ngc.check_hidden('98.1', lambda rng: [(10**9,)])",
                      metadata={"tags": ["hidden"]}),
        new_markdown_cell("## Exercise 98.2 — negate"),
        new_code_cell(f"def neg(x):\n    {BEGIN}\n    return -x\n    {END}"),
        new_code_cell("# Check 98.2 — negate\ngc.check_exercise('98.2', neg, lambda rng: [(3,), (-2,), (0,)])",
                      metadata={"tags": ["check"]}),
        new_code_cell("# Hidden 98.2 — floats\ngc.check_hidden('98.2', lambda rng: [(1.5,)])",
                      metadata={"tags": ["hidden"]}),
    ])


@pytest.fixture
def course(tmp_path):
    sol, rel = tmp_path / "solutions", tmp_path / "exercises"
    sol.mkdir()
    rel.mkdir()
    nbformat.write(_solutions(), sol / NAME)
    nbformat.write(make_exercise_notebook(_solutions(), name=NAME), rel / NAME)
    return tmp_path


def _submission(course, square_body, neg_body="return -x", extra_cells=(), name=NAME):
    nb = nbformat.read(course / "exercises" / NAME, as_version=4)
    for cell in nb.cells:
        if cell.source.startswith("def square"):
            cell.source = f"def square(x):\n    {square_body}"
        elif cell.source.startswith("def neg"):
            cell.source = f"def neg(x):\n    {neg_body}"
    at = next(i for i, c in enumerate(nb.cells) if c.source.startswith("## Exercise 98.2"))
    nb.cells[at:at] = list(extra_cells)
    path = course / "work" / name
    path.parent.mkdir(exist_ok=True)
    nbformat.write(nb, path)
    return path


def _check(course, *paths, args=()):
    return subprocess.run([sys.executable, "-m", "gpucourse", "check", "--release", str(course / "exercises"),
                           "--solutions", str(course / "solutions"), *args, *map(str, paths)],
                          capture_output=True, text=True, timeout=240)


def test_completed_notebook_passes(course):
    r = _check(course, _submission(course, "return x * x"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "98.1  ✓  square on random inputs" in r.stdout and "2 of 2 checks pass" in r.stdout
    assert "seed" not in r.stdout                         # nothing to replay


@pytest.mark.parametrize("body, error, replayable", [
    ('raise NotImplementedError("Exercise 98.1")', "not implemented yet", False),
    ("return 4", "expected", True),                        # a constant answer fails, saying what was expected
    ("return abs(x) * 2", "expected", True),
    # an error that only reads like the judge's "unsolved" verdict is a wrong answer like any other
    ('raise ValueError(f"98.1: not implemented yet ({x})")', "ValueError", True),
])
def test_unfinished_or_wrong_notebook_fails_at_its_check(course, body, error, replayable):
    r = _check(course, _submission(course, body))
    assert r.returncode == 1
    line = next(l for l in r.stdout.splitlines() if "98.1" in l)
    assert "✗" in line and error in line, line
    assert "98.2  ✓" in r.stdout                          # the other exercise is still graded
    # a wrong answer's inputs can be replayed; an unsolved exercise's do not matter (the judge's
    # verdict says which, not the error's wording)
    assert ("(inputs drawn from seed" in r.stdout) == replayable, r.stdout


def test_error_in_a_non_check_cell_is_reported(course):
    r = _check(course, _submission(course, "return x * x", extra_cells=[new_code_cell("1 / 0")]))
    assert r.returncode == 1 and "(not a check cell) — ZeroDivisionError" in r.stdout


def test_a_cell_too_deep_to_compile_fails_at_once_and_the_rest_runs(course):
    """IPython lets the RecursionError of its await-probe escape, and ipykernel never answered such a
    cell: the run waited the whole cell timeout, then stopped (98.2 did not run)."""
    deep = new_code_cell("_ = " + "+".join(["1"] * 60_000))
    r = _check(course, _submission(course, "return x * x", extra_cells=[deep]), args=["--cell-timeout", "60"])
    assert r.returncode == 1, r.stdout + r.stderr
    assert "(not a check cell) — RecursionError" in r.stdout, r.stdout
    assert re.search(r"98\.1 +✓", r.stdout) and re.search(r"98\.2 +✓", r.stdout), r.stdout
    assert "longer than" not in r.stdout, r.stdout


def test_notebook_of_no_course_chapter_fails(course):
    path = course / "work" / "mine.ipynb"
    path.parent.mkdir(exist_ok=True)
    nbformat.write(new_notebook(cells=[new_code_cell("x = 1")]), path)
    r = _check(course, path)
    assert r.returncode == 1 and "no release" in r.stdout


def test_folder_of_submissions_gives_summary(course):
    _submission(course, "return x * x", name="98_alice.ipynb")
    _submission(course, "return 0", name="98_bob.ipynb")
    r = _check(course, course / "work")
    assert r.returncode == 1
    summary = r.stdout.split("summary")[1]
    assert "✓  2/2" in summary and "98_alice.ipynb" in summary
    assert "✗  1/2" in summary and "98_bob.ipynb" in summary


def test_missing_file(tmp_path):
    r = subprocess.run([sys.executable, "-m", "gpucourse", "check", str(tmp_path / "nope.ipynb")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no such file" in r.stderr


def test_hanging_cell_is_stopped_by_the_cell_timeout_and_stored_outputs_do_not_count(course):
    """A check the run never reached (after a hanging cell) is not run, whatever its stored output says."""
    path = _submission(course, "return x * x", extra_cells=[new_code_cell("import time\ntime.sleep(120)")])
    nb = nbformat.read(path, as_version=4)
    for count, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        cell.execution_count = count + 1
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="98.2 passed ✓\n")]
    nbformat.write(nb, path)
    # 20 s, not less: the first cell imports torch, which took over 3 s on a loaded CI machine
    r = _check(course, path, args=["--cell-timeout", "20"])
    assert r.returncode == 1, r.stdout + r.stderr
    assert "98.1  ✓" in r.stdout, r.stdout                # ran before the hang
    assert "98.2  ✗" in r.stdout and "did not run: a cell ran longer than 20 s" in r.stdout, r.stdout


def test_same_seed_same_inputs(course):
    """A wrong answer that is right on some inputs: the failure names the seed, and that seed reproduces it."""
    import re

    path = _submission(course, "return x * x if x % 3 else 0")
    first = _check(course, path)                           # a seed of its own, as a learner runs it
    found = re.search(r"\(inputs drawn from seed (\d+): the same inputs again with --seed \1\)", first.stdout)
    assert first.returncode == 1 and found, first.stdout + first.stderr
    again = _check(course, path, args=["--seed", found[1]])
    line = next(l for l in first.stdout.splitlines() if "98.1" in l)
    assert "98.1  ✗" in line and line == next(l for l in again.stdout.splitlines() if "98.1" in l), again.stdout
    assert f"seed {found[1]}:" in again.stdout


def test_check_says_it_ran_the_visible_checks_and_check_hidden_runs_the_hidden_ones(course):
    """A chapter-05 notebook with wrong answers got "6 of 6 checks pass" from `check` and 2/6 from
    `grade --hidden` (issue 38): `check` says what it decided on, and `check --hidden` decides as
    `grade --hidden` does."""
    sub = _submission(course, "return x * x if abs(x) < 1000 else 0")     # right on the visible inputs only
    r = _check(course, sub)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 of 2 checks pass — the visible checks on fresh inputs" in r.stdout
    assert "check --hidden" in r.stdout
    r = _check(course, sub, args=["--hidden"])
    assert r.returncode == 1, r.stdout + r.stderr
    line = next(l for l in r.stdout.splitlines() if "98.1" in l)
    assert "✓  hidden ✗" in line and "hidden check of 98.1" in line, line
    assert "98.2  ✓  hidden ✓" in r.stdout
    assert "1 of 2 exercises pass their visible and hidden checks" in r.stdout


def test_check_hidden_without_the_answer_key_says_why(course, tmp_path):
    import shutil

    sub = _submission(course, "return x * x")
    shutil.rmtree(course / "solutions")                    # a class: the instructor kept solutions/
    r = subprocess.run([sys.executable, "-m", "gpucourse", "check", "--hidden", "--release",
                        str(course / "exercises"), str(sub)], capture_output=True, text=True, timeout=240,
                       cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--hidden needs the course's solutions/" in r.stderr


# --- the release a self-check restores from is untouched, even where the learner works in it ----------


def _edit_in_place(course, square_body, check_edit):
    """The learner works in the release notebook itself (exercises/ of a checkout, as the README's
    `make check NB=exercises/…` does): their answer, and an edit of 98.1's check cell."""
    path = course / "exercises" / NAME
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.source.startswith("def square"):
            cell.source = f"def square(x):\n    {square_body}"
        elif cell.source.startswith("# Check 98.1"):
            cell.source = check_edit(cell.source)
    nbformat.write(nb, path)
    return path


def _check_here(course, path, *args):
    """`check` as a learner types it in the course folder: no --release, no --solutions."""
    return subprocess.run([sys.executable, "-m", "gpucourse", "check", *args, str(path)], cwd=course,
                          capture_output=True, text=True, timeout=240)


# the check cell edited so that any answer passes: the kernel sends the right squares, whatever square is
_ANY_ANSWER_PASSES = lambda source: source.replace("gc.check_exercise('98.1', square,",   # noqa: E731
                                                   "gc.check_exercise('98.1', lambda x: x * x,")


def test_an_edited_check_cell_in_the_release_itself_is_restored_from_solutions(course, monkeypatch):
    from gpucourse.grading.selfcheck import _find_releases

    path = _edit_in_place(course, "return x + x", _ANY_ANSWER_PASSES)
    monkeypatch.chdir(course)
    release = _find_releases(path, None)["98"]
    in_place = nbformat.read(path, as_version=4)                      # the learner's edited copy
    want = next(c.source for c in _solutions().cells if c.source.startswith("# Check 98.1"))
    assert release.checks["98.1"].source == want != next(
        c.source for c in in_place.cells if c.source.startswith("# Check 98.1"))
    assert release.path.parent == course / "solutions"

    r = _check_here(course, path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "98.1  ✗" in r.stdout and "(check cell was edited — restored)" in r.stdout, r.stdout


def test_an_edited_check_cell_with_no_untouched_copy_around_does_not_pass(course):
    from gpucourse.grading.exercises import generate_public_cases

    generate_public_cases(course / "solutions", course / "exercises")   # the class's release, shipped
    for p in (course / "solutions").iterdir():                    # without the answer key
        p.unlink()
    honest = _submission(course, "return x * x")
    assert "2 of 2 checks pass on the public cases" in _check_here(course, honest).stdout
    path = _edit_in_place(course, "return x + x", _ANY_ANSWER_PASSES)
    r = _check_here(course, path)
    assert r.returncode == 1, r.stdout + r.stderr
    row = next(line for line in r.stdout.splitlines() if "98.1" in line)
    assert "✗" in row and "the course's check did not run" in row and "was edited" in row, r.stdout
    assert "98.2  " in r.stdout and "did not run" not in next(
        line for line in r.stdout.splitlines() if "98.2" in line)


def _delete_check_in_place(course, square_body):
    path = course / "exercises" / NAME
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.source.startswith("def square"):
            cell.source = f"def square(x):\n    {square_body}"
    nb.cells = [c for c in nb.cells if not c.source.startswith("# Check 98.1")]
    nbformat.write(nb, path)
    return path


@pytest.mark.parametrize("answer_key", [True, False])
def test_a_check_cell_deleted_from_the_release_itself_is_put_back_or_reported(course, answer_key):
    """`2 of 2 pass` with 98.1's check cell deleted in exercises/ itself: the release was the notebook,
    so 98.1 had no check at all, and the wrong answer no row."""
    if not answer_key:
        from gpucourse.grading.exercises import generate_public_cases

        generate_public_cases(course / "solutions", course / "exercises")
        for p in (course / "solutions").iterdir():
            p.unlink()
    path = _delete_check_in_place(course, "return x + x")
    r = _check_here(course, path)
    assert r.returncode == 1, r.stdout + r.stderr
    row = next((line for line in r.stdout.splitlines() if "98.1" in line), "")
    if answer_key:
        assert "98.1  ✗" in row and "(check cell was deleted — put back)" in row, r.stdout
    else:
        assert "98.1  ✗" in row and "check cell was deleted from the only release notebook here" in row, r.stdout


def test_the_notebook_is_its_own_release_only_when_nothing_else_is_here_and_release_is_as_given(course, monkeypatch):
    from gpucourse.grading.selfcheck import _find_releases

    path = _edit_in_place(course, "return x * x", lambda source: source)
    monkeypatch.chdir(course)
    # the notebook being checked is no release of itself: the course's solutions/ gives an untouched one
    assert _find_releases(path, None)["98"].path == course / "solutions" / NAME
    for p in (course / "solutions").iterdir():
        p.unlink()
    assert _find_releases(path, None)["98"].path == path            # nothing else here: the notebook itself
    edited = _edit_in_place(course, "return x * x", _ANY_ANSWER_PASSES)
    assert _find_releases(edited, str(course / "exercises"))["98"].path == edited   # --release: as given
