"""``python -m gpucourse export-nbgrader DIR``: the course as nbgrader source assignments.

Our solution markers are nbgrader's (``### BEGIN SOLUTION`` / ``### END SOLUTION``), so a solutions
notebook maps onto nbgrader's cell metadata directly::

    cell with a solution region  → {"solution": true,  "grade": false, "locked": false, "grade_id": "exNN_k-answer"}
    check cell "# Check NN.k"    → {"solution": false, "grade": true,  "locked": true,  "grade_id": "exNN_k",
                                    "points": <points metadata, default 1>}
    hidden cells "# Hidden NN.k" → left out: the judge holds them (see below)
    every other cell             → {"locked": true, ...} (the lesson text and set-up code)

One assignment per chapter (``DIR/source/00_setup/00_setup_exercises.ipynb``, …), or the chapters
given with ``--chapter`` into one ``--assignment``. An ``nbgrader_config.py`` is written when the
folder has none (paths in it relative to the file, so the folder can move): the course id
(``--course-id``), the root, where the judge finds the course's solutions, and
``GPUCOURSE_HIDDEN_CHECKS=1`` — so in ``nbgrader autograde`` each check cell runs its exercise's
hidden check too, through the judge, and the cell (its ``points``) passes only when both pass: the
same rule as ``python -m gpucourse grade --hidden``. No hidden test is ever in a notebook, so an
untouched check cell keeps nbgrader's checksum (no "Attribute 'checksum' … has changed!" noise,
nbgrader issue #1961), a real edit still warns, and feedback cannot show a hidden test's source.

.. warning::
   nbgrader decides inside the student's kernel (a check cell's exception is the verdict): a
   student who patches the kernel can fake it there. ``python -m gpucourse grade`` does not have
   that weakness (its judge runs outside every student process); prefer it for grades that count.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import nbformat

from .exercises import CHECK_TAG, exercise_index
from .restore import HIDDEN_TAG

__all__ = ["NBGRADER_SCHEMA", "assignment_name", "export_nbgrader", "grade_id", "to_nbgrader"]

NBGRADER_SCHEMA = 3

CONFIG = '''\
# Written by `python -m gpucourse export-nbgrader`; edit freely (it is not overwritten).
import os
import warnings

# nbgrader 0.9 with SQLAlchemy 2.x warns "Object of type <SubmittedAssignment> not in session, add
# operation along 'Student.submissions' will not proceed" on every autograde: SQLAlchemy 2 no longer
# cascades backrefs, and nbgrader adds the object itself right after. Harmless; silenced here.
warnings.filterwarnings("ignore", message=r"Object of type <\\w+> not in session")

# No absolute path: the course folder is the one this file is in, wherever it is copied or moved.
HERE = os.path.dirname(os.path.abspath(__file__))

c = get_config()  # noqa: F821 - nbgrader's config loader provides it
c.CourseDirectory.course_id = {course_id}
c.CourseDirectory.root = HERE
c.ExecutePreprocessor.timeout = 600
# a deleted check cell is put back (as `gpucourse grade` does), not silently worth 0 points
c.OverwriteCells.add_missing_cells = True

# The course's checks are decided by a judge process that runs the course's own solutions on the
# check's inputs (never inside the student's code): it needs to find them.
{solutions}
# Every check cell also runs its exercise's hidden check (held by the judge, never in a notebook):
# an exercise earns its points only when both pass, as in `gpucourse grade --hidden`.
os.environ["GPUCOURSE_HIDDEN_CHECKS"] = "1"

# Feedback cannot show a hidden test: the course puts none in a notebook (the judge holds them). Were
# you to add nbgrader hidden tests of your own, add "nbgrader.preprocessors.ClearHiddenTests" to
# c.GenerateFeedback.preprocessors (nbgrader then warns "Config option display_data_priority not
# recognized by ClearHiddenTests": nbconvert's HTML exporter sets that option for every
# preprocessor, and nbgrader's own do not take it; harmless).
'''

#: where the judge finds the course's solutions, in the config: by default the ones next to the
#: package (nothing to write); others relative to the config file
SOLUTIONS_DEFAULT = ("# The judge finds them next to the gpucourse package (the course's solutions/);\n"
                     "# set GPUCOURSE_SOLUTIONS to use others.")
SOLUTIONS_RELATIVE = 'os.environ.setdefault("GPUCOURSE_SOLUTIONS", os.path.join(HERE, {relative}))'


def grade_id(exercise: str) -> str:
    """nbgrader's id of an exercise's check (``[A-Za-z0-9_-]`` only): ``04.2`` → ``ex04_2``."""
    return "ex" + exercise.replace(".", "_")


def assignment_name(notebook: str | Path) -> str:
    """The assignment a chapter becomes: ``08_sharded_data_parallel_exercises.ipynb`` → ``08_sharded_data_parallel``."""
    return Path(notebook).stem.removesuffix("_exercises")


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
            cell.metadata["nbgrader"] = _meta(grade_id(ex), grade=True, points=points)
            cell.metadata["tags"] = [t for t in tags if t != CHECK_TAG] + [CHECK_TAG]
        else:
            cell.metadata["nbgrader"] = _meta(f"cell-{i}")
        cells.append(cell)
    out.cells = cells
    out.metadata.pop("gpucourse", None)
    return out


def _public_cases(chapter: str) -> Path | None:
    """The course's public cases file of ``chapter`` (next to the package), if there is one."""
    from .harness import _PACKAGE_DIR
    from .public import public_name

    path = Path(_PACKAGE_DIR).parent / "exercises" / "public" / public_name(chapter)
    return path if path.is_file() else None


def export_nbgrader(dest: str | Path, *, solutions: str | Path | None = None, chapters: list[str] | None = None,
                    assignment: str | None = None, course_id: str = "gpucourse") -> list[Path]:
    """Write ``dest/source/<assignment>/NN_*.ipynb`` (and ``dest/nbgrader_config.py`` if missing).

    Args:
        dest: the nbgrader course folder.
        solutions: the course's solutions folder (default: the one of the course this package
            belongs to).
        chapters: ``["00", "08"]``; default every chapter.
        assignment: one assignment for all the chapters; default one per chapter, named by
            :func:`assignment_name`.
        course_id: nbgrader's course id, written into the config.

    Returns the notebooks written (the config file is not in the list).
    """
    given = solutions
    if solutions is None:
        from .harness import _PACKAGE_DIR

        solutions = Path(_PACKAGE_DIR).parent / "solutions"
    sources = sorted(Path(solutions).glob("[0-9][0-9]_*.ipynb"))
    if not sources:
        raise FileNotFoundError(f"no solutions notebooks (NN_*.ipynb) in {str(solutions)!r}")
    if chapters:
        unknown = sorted(set(chapters) - {p.name[:2] for p in sources})
        if unknown:
            raise ValueError(f"no chapter {', '.join(unknown)} in {str(solutions)!r} (chapters: "
                             f"{', '.join(p.name[:2] for p in sources)})")
        sources = [p for p in sources if p.name[:2] in chapters]
    dest = Path(dest)
    written = []
    for src in sources:
        folder = dest / "source" / (assignment or assignment_name(src))
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / src.name
        nbformat.write(to_nbgrader(nbformat.read(src, as_version=4), name=src.name), path)
        written.append(path)
        # the chapter's public cases travel with the assignment (nbgrader releases every file of the
        # source folder): a student's check cell and `nbgrader validate` judge on them, no solutions/
        public = _public_cases(src.name[:2])
        if public is not None:
            (folder / "public").mkdir(exist_ok=True)
            shutil.copyfile(public, folder / "public" / public.name)
    config = dest / "nbgrader_config.py"
    if not config.exists():
        if given is None:
            where = SOLUTIONS_DEFAULT
        else:
            relative = os.path.relpath(Path(given).resolve(), dest.resolve())
            where = SOLUTIONS_RELATIVE.format(relative=json.dumps(relative))
        config.write_text(CONFIG.format(course_id=json.dumps(course_id), solutions=where), encoding="utf-8")
    return written
