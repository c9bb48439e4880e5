"""Shared helpers for the grading tests: a tiny release built by the real generator, and a class
of course notebooks graded as an instructor would."""

import json
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from gpucourse.grading.exercises import BEGIN, END, make_exercise_notebook

TINY = "99_tiny_exercises.ipynb"
SETUP = "import gpucourse as gc"
CHECK = """# Check 99.1 — square of small numbers
def cases(rng):
    return [(v,) for v in range(-3, 4)] + [(rng.randint(-50, 50),) for _ in range(5)]


gc.check_exercise("99.1", square, cases, hint="multiply x by itself")"""
HIDDEN = """# Hidden 99.1 — square of large numbers
def hidden_cases(rng):
    return [(10**6,), (rng.randint(10**5, 10**7),)]


gc.check_hidden("99.1", hidden_cases)"""


def tiny_solutions(extra_cells=(), hidden=False, points=None):
    check_meta = {"tags": ["check"], **({"points": points} if points else {})}
    cells = [
        new_markdown_cell("# 99 · tiny"),
        new_code_cell(SETUP),
        new_markdown_cell("## Exercise 99.1 — square"),
        new_code_cell(f"def square(x):\n    {BEGIN}\n    return x * x\n    {END}"),
        new_code_cell(CHECK, metadata=check_meta),
    ]
    if hidden:
        cells.append(new_code_cell(HIDDEN, metadata={"tags": ["hidden"]}))
    cells += [*extra_cells]
    return new_notebook(cells=cells)


def write_tiny_course(root: Path, nb) -> tuple[Path, Path]:
    """``root/solutions`` holding ``nb`` (chapter 99's solutions) and ``root/release`` its release, as
    ``make exercises`` builds it; returns (release folder, solutions folder)."""
    sol, rel = root / "solutions", root / "release"
    sol.mkdir()
    rel.mkdir()
    nbformat.write(nb, sol / TINY)
    nbformat.write(make_exercise_notebook(nb, name=TINY), rel / TINY)
    return rel, sol


@pytest.fixture
def tiny_release(tmp_path):
    """(release folder, solutions folder) for chapter 99."""
    return write_tiny_course(tmp_path, tiny_solutions(hidden=True, points=3))


def tiny_submission(folder: Path, student: str, answer: str, extra=(), before=False) -> Path:
    """The release notebook with ``answer`` as square's body and ``extra`` cells appended (or put
    before the answer with ``before=True``)."""
    nb = nbformat.read(next(folder.parent.glob("release")) / TINY, as_version=4)
    answer_cell = next(i for i, c in enumerate(nb.cells) if c.source.startswith("def square"))
    nb.cells[answer_cell].source = f"def square(x):\n    {answer}"
    if before:
        nb.cells[answer_cell:answer_cell] = [new_code_cell(src) for src in extra]
    else:
        nb.cells += [new_code_cell(src) for src in extra]
    path = folder / student / TINY
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def grade_class(tmp_path: Path, notebooks: dict) -> dict:
    """``grade --hidden`` (2 workers) over ``{student: (notebook, file name)}`` against the course's
    release and solutions: the gradebook's JSON (``rows``, ``notebooks``)."""
    from gpucourse.grading.grade import Options, grade

    root = Path(__file__).resolve().parents[2]
    subs = tmp_path / "subs"
    for student, (nb, name) in notebooks.items():
        (subs / student).mkdir(parents=True)
        nbformat.write(nb, subs / student / name)
    out = tmp_path / "g.json"
    grade([str(subs)], release=str(root / "exercises"), hidden_from=str(root / "solutions"), workers=2,
          json_path=str(out), quiet=True, options=Options(cell_timeout=120, notebook_timeout=300))
    return json.loads(out.read_text())
