"""``python -m gpucourse export-nbgrader DIR``: the course as an nbgrader source assignment.

Our solution markers are nbgrader's (``### BEGIN SOLUTION`` / ``### END SOLUTION``), so a solutions
notebook maps onto nbgrader's cell metadata directly::

    cell with a solution region  → {"solution": true,  "grade": false, "locked": false, "grade_id": "exNN_k-answer"}
    check cell "# Check NN.k"    → {"solution": false, "grade": true,  "locked": true,  "grade_id": "exNN_k",
                                    "points": <points metadata, default 1>}
    hidden cells "# Hidden NN.k" → appended to that check cell inside
                                    ### BEGIN HIDDEN TESTS / ### END HIDDEN TESTS
    every other cell             → {"locked": true, ...} (the lesson text and set-up code)

``solution-only`` cells are dropped. The files go to ``DIR/source/<assignment>/NN_*.ipynb``; then
``nbgrader generate_assignment <assignment>`` in DIR makes the student version.
"""

from __future__ import annotations

import copy
from pathlib import Path

import nbformat

from .exercises import CHECK_TAG, exercise_index
from .restore import HIDDEN_HEADER, HIDDEN_TAG

__all__ = ["NBGRADER_SCHEMA", "export_nbgrader", "grade_id", "to_nbgrader"]

NBGRADER_SCHEMA = 3


def grade_id(exercise: str) -> str:
    """nbgrader's id of an exercise's check (``[A-Za-z0-9_-]`` only): ``04.2`` → ``ex04_2``."""
    return "ex" + exercise.replace(".", "_")


def _meta(grade_id: str, *, solution=False, grade=False, locked=True, points=None, task=False) -> dict:
    meta = {"grade": grade, "grade_id": grade_id, "locked": locked, "schema_version": NBGRADER_SCHEMA,
            "solution": solution, "task": task}
    if grade:
        meta["points"] = points
    return meta


def to_nbgrader(nb, *, name: str = "notebook"):
    """A solutions notebook with nbgrader metadata (a new notebook; ``nb`` is not changed)."""
    index = exercise_index(nb, name=name)
    answer_of = {i: ex.id for ex in index.values() for i in ex.solution_cells}
    check_of = {ex.check_cells[0]: ex.id for ex in index.values()}
    hidden: dict[str, list[str]] = {}
    for cell in nb.cells:
        first = cell.source.lstrip().splitlines()[0] if cell.source.strip() else ""
        m = HIDDEN_HEADER.match(first) if cell.cell_type == "code" else None
        if m and HIDDEN_TAG in cell.metadata.get("tags", []):
            hidden.setdefault(m["id"], []).append(cell.source)
    out = copy.deepcopy(nb)
    cells = []
    answers_seen: dict[str, int] = {}
    for i, cell in enumerate(out.cells):
        tags = cell.metadata.get("tags", [])
        if "solution-only" in tags or HIDDEN_TAG in tags:
            continue
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        cell.metadata.pop("execution", None)
        if i in answer_of:
            ex = answer_of[i]
            n = answers_seen.get(ex, 0)
            answers_seen[ex] = n + 1
            cell.metadata["nbgrader"] = _meta(f"{grade_id(ex)}-answer" + (f"-{n + 1}" if n else ""), solution=True,
                                              locked=False)
        elif i in check_of:
            ex = check_of[i]
            points = cell.metadata.get("points", 1)
            if hidden.get(ex):
                cell.source = (cell.source.rstrip() + "\n\n### BEGIN HIDDEN TESTS\n"
                               + "\n\n".join(h.strip() for h in hidden[ex]) + "\n### END HIDDEN TESTS")
            cell.metadata["nbgrader"] = _meta(grade_id(ex), grade=True, points=points)
            cell.metadata["tags"] = [t for t in tags if t != CHECK_TAG] + [CHECK_TAG]
        else:
            cell.metadata["nbgrader"] = _meta(f"cell-{i}")
        cells.append(cell)
    out.cells = cells
    out.metadata.pop("gpucourse", None)
    return out


def export_nbgrader(solutions: str | Path, dest: str | Path, *, assignment: str = "gpucourse") -> list[Path]:
    """Write ``dest/source/<assignment>/NN_*.ipynb`` from ``solutions``; return the files written."""
    sources = sorted(Path(solutions).glob("[0-9][0-9]_*.ipynb"))
    if not sources:
        raise FileNotFoundError(f"no solutions notebooks (NN_*.ipynb) in {str(solutions)!r}")
    folder = Path(dest) / "source" / assignment
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for src in sources:
        nb = to_nbgrader(nbformat.read(src, as_version=4), name=src.name)
        path = folder / src.name
        nbformat.write(nb, path)
        written.append(path)
    return written
