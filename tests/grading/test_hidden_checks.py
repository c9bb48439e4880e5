"""Hidden checks: every exercise has one, ``exercises/`` never shows them, and each is worth having.

A hidden check (a code cell tagged ``hidden`` right after an exercise's visible check, first line
``# Hidden NN.k — …``) tests what the visible check does not. The proof that it does: per chapter, a
planted wrong answer — plausible, and passing the visible check — that the hidden check catches.
Only the chapter's setup cells and that exercise's cells run, in a fresh kernel, with ``random``
seeded so the visible check is deterministic.
"""

import re
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from gpucourse.grading.check import run_notebook
from gpucourse.grading.exercises import (BEGIN, END, HIDDEN_HEADER, HIDDEN_TAG, EXERCISE_HEADING,
                                         exercise_index, generate_exercises,
                                         make_exercise_notebook)

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("[0-9][0-9]_*.ipynb"))


def _tags(cell):
    return cell.get("metadata", {}).get("tags", [])


# --- the generator drops hidden checks -------------------------------------------------------

def test_make_exercise_notebook_drops_hidden_cells():
    nb = new_notebook(cells=[
        new_markdown_cell("## Exercise 99.1 — double"),
        new_code_cell(f"def double(x):\n    {BEGIN}\n    return 2 * x\n    {END}"),
        new_code_cell("# Check 99.1 — double\nassert double(2) == 4", metadata={"tags": ["check"]}),
        new_code_cell("# Hidden 99.1 — negative numbers\nassert double(-3) == -6",
                      metadata={"tags": [HIDDEN_TAG]}),
    ])
    index = exercise_index(nb)
    assert index["99.1"].hidden_cells == [3]
    out = make_exercise_notebook(nb)
    assert [c.source.splitlines()[0] for c in out.cells][-1].startswith("# Check 99.1")
    assert len(out.cells) == 3


@pytest.mark.parametrize("source, tags, msg", [
    ("# Hidden 99.2 — x\nassert 1", [HIDDEN_TAG], "hidden check for 99.2 inside exercise 99.1"),
    ("# Hidden 99.1 — x\nassert 1", [], "not tagged 'hidden'"),
    ("assert 1", [HIDDEN_TAG], "must start with '# Hidden NN.k"),
    ("# Hidden 99.1 — x\nassert 1", [HIDDEN_TAG, "check"], "both 'check' and 'hidden'"),
])
def test_hidden_cell_conventions_are_enforced(source, tags, msg):
    from gpucourse.grading.exercises import ExerciseFormatError
    nb = new_notebook(cells=[
        new_markdown_cell("## Exercise 99.1 — double"),
        new_code_cell(f"def double(x):\n    {BEGIN}\n    return 2 * x\n    {END}"),
        new_code_cell("# Check 99.1 — double\nassert double(2) == 4", metadata={"tags": ["check"]}),
        new_code_cell(source, metadata={"tags": tags}),
    ])
    with pytest.raises(ExerciseFormatError, match=re.escape(msg)):
        exercise_index(nb)


@pytest.mark.parametrize("path", EXERCISES, ids=[p.name for p in EXERCISES])
def test_shipped_exercises_contain_no_hidden_check(path):
    nb = nbformat.read(path, as_version=4)
    for index, cell in enumerate(nb.cells):
        assert HIDDEN_TAG not in _tags(cell), f"{path.name} cell {index} is tagged 'hidden'"
        assert "# Hidden" not in cell.source, f"{path.name} cell {index} contains '# Hidden'"
        assert "hidden passed" not in str(cell.get("outputs", "")), f"{path.name} cell {index}"


def test_generated_exercises_contain_no_hidden_check(tmp_path):
    generate_exercises(ROOT / "solutions", tmp_path)
    for path in sorted(tmp_path.glob("*.ipynb")):
        text = path.read_text(encoding="utf-8")
        assert "# Hidden" not in text and '"hidden"' not in text, path.name


# --- every exercise has a hidden check --------------------------------------------------------

@pytest.mark.parametrize("path", SOLUTIONS, ids=[p.name for p in SOLUTIONS])
def test_every_exercise_has_a_hidden_check_after_its_visible_check(path):
    nb = nbformat.read(path, as_version=4)
    for ex in exercise_index(nb, name=path.name).values():
        assert ex.hidden_cells, f"{path.name}: exercise {ex.id} has no hidden check"
        assert min(ex.hidden_cells) > ex.check_cells[0], f"{path.name}: {ex.id} hidden before check"
        for i in ex.hidden_cells:
            source = nb.cells[i].source
            assert HIDDEN_HEADER.match(source.splitlines()[0])["title"].strip(), (
                f"{path.name} cell {i}: say what the hidden check tests")
            assert f'print("{ex.id} hidden passed ✓")' in source, f"{path.name} cell {i}"
            outputs = "".join(o.get("text", "") for o in nb.cells[i].get("outputs", []))
            assert f"{ex.id} hidden passed ✓" in outputs, (
                f"{path.name} cell {i}: stored output does not show the hidden check passing "
                "(re-execute the solutions notebook)")


# --- each chapter: a planted wrong answer passes the visible check, fails the hidden one ------

#: chapter -> (exercise id, the wrong answer that replaces the body of its solution region(s)).
#: Several regions in the exercise (04.4, 07.4) take a list, one entry per region, None = keep.
PLANTED = {
    "00": ("00.2", "return [int(x) for x in spec.split(',')][logical]   # ids[-1] for cuda:-1"),
}


def _plant(source: str, answers: list) -> str:
    """Replace the k-th solution region of ``source`` by ``answers[k]`` (None keeps the region)."""
    out, inside, k = [], False, 0
    for line in source.splitlines():
        stripped = line.strip()
        if stripped == BEGIN:
            inside, indent = True, line[: len(line) - len(line.lstrip())]
            keep = answers[k] is None
            if not keep:
                out.extend(indent + l for l in answers[k].splitlines())
            k += 1
        elif stripped == END:
            inside = False
        elif not inside or keep:
            out.append(line)
    assert k == len(answers), f"{k} solution regions, {len(answers)} answers"
    return "\n".join(out)


def planted_notebook(path: Path, exercise_id: str, wrong, *, seed: int = 0):
    """The chapter's setup cells, ``random.seed(seed)``, then exercise ``exercise_id`` with its
    solution replaced by ``wrong``; returns (notebook, index of the check cell, of the hidden cell)."""
    nb = nbformat.read(path, as_version=4)
    ex = exercise_index(nb, name=path.name)[exercise_id]
    first_heading = next(i for i, c in enumerate(nb.cells)
                         if c.cell_type == "markdown" and EXERCISE_HEADING.search(c.source))
    heading = next(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown"
                   and (m := EXERCISE_HEADING.search(c.source)) and m["id"] == exercise_id)
    last = max(ex.hidden_cells)
    cells = [c for c in nb.cells[:first_heading] if c.cell_type == "code"]
    cells.append(new_code_cell(f"import random\nrandom.seed({seed})"))
    answers = wrong if isinstance(wrong, list) else [wrong]
    taken = 0
    check = hidden = None
    for i in range(heading, last + 1):
        cell = nb.cells[i]
        if cell.cell_type != "code":
            continue
        if i in ex.solution_cells:
            regions = sum(l.strip() == BEGIN for l in cell.source.splitlines())
            cell.source = _plant(cell.source, answers[taken:taken + regions])
            taken += regions
        if i == ex.check_cells[0]:
            check = len(cells)
        if i == ex.hidden_cells[0]:
            hidden = len(cells)
        cells.append(cell)
    assert taken == len(answers), f"{exercise_id}: {taken} regions, {len(answers)} answers"
    return new_notebook(cells=cells, metadata=nb.metadata), check, hidden


def _error(cell):
    err = next((o for o in cell.get("outputs", []) if o.output_type == "error"), None)
    return f"{err.ename}: {err.evalue.splitlines()[0] if err.evalue else ''}" if err else ""


def run_planted(chapter: str, exercise_id: str, wrong, tmp_path, *, seed: int = 0):
    """(visible error, hidden error) of the planted answer ('' = that check passed)."""
    path = next(p for p in SOLUTIONS if p.name.startswith(chapter + "_"))
    nb, check, hidden = planted_notebook(path, exercise_id, wrong, seed=seed)
    variant = tmp_path / path.name
    nbformat.write(nb, variant)
    executed, fatal = run_notebook(variant, cell_timeout=60)
    assert not fatal, fatal
    for i, cell in enumerate(executed.cells[:check]):
        assert not _error(cell), f"setup/solution cell {i} failed: {_error(cell)}"
    return _error(executed.cells[check]), _error(executed.cells[hidden])


@pytest.mark.parametrize("chapter", sorted(PLANTED))
def test_planted_wrong_answer_passes_visible_fails_hidden(chapter, tmp_path):
    exercise_id, wrong = PLANTED[chapter]
    visible, hidden = run_planted(chapter, exercise_id, wrong, tmp_path)
    assert not visible, f"{exercise_id}: the planted answer should pass the visible check: {visible}"
    assert hidden, f"{exercise_id}: the hidden check passed the planted wrong answer"


def test_every_chapter_has_a_planted_wrong_answer():
    assert sorted(PLANTED) == sorted(p.name[:2] for p in SOLUTIONS)
