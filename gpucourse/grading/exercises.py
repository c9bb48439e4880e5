"""The exercise pipeline: ``solutions/`` is the single source, ``exercises/`` is generated from it.

A solutions notebook marks every exercise like this::

    ## Exercise 04.2 — ring all-reduce            <- markdown heading with the exercise id

    def ring_all_reduce(tensor):                    <- code cell the learner completes
        ### BEGIN SOLUTION
        ...the reference answer...
        ### END SOLUTION

    # Check 04.2 — equals dist.all_reduce           <- code cell tagged "check": says how to run
    def cases(rng): ...                                the learner's code on random inputs and
    gc.check_exercise("04.2", ring_all_reduce, cases)  how to compare; the judge decides (see
                                                       :mod:`.harness`; a stub must fail)

:func:`make_exercise_notebook` replaces each solution region by a stub that raises
``NotImplementedError`` (keeping the region's indentation, so a function body stays a function
body) and clears the outputs and execution counts of every cell — check cells included, so a
shipped notebook never looks solved. Cells tagged ``solution-only`` are dropped, and so are hidden
checks: the one code cell tagged ``hidden`` after an exercise's visible check, first line
``# Hidden 04.2 — …``, calling ``gc.check_hidden("04.2", cases)``: more cases (random sizes, edge
cases, a property) for the instructor's grader only. The release carries what the grader needs to trust nothing in a
submission (:mod:`.restore`): the notebook's chapter in ``metadata.gpucourse``, and on every check
cell its exercise id, points (default 1, or the solution cell's ``points`` metadata) and a content
hash. Each exercise's heading says what a pass prints.

Beside the release, :func:`generate_public_cases` writes ``exercises/public/NN_public_cases.json``:
each visible check's *public cases* — the first inputs it draws from a fixed public seed and the
course's values for them, computed by the real judge on ``solutions/`` (data only; see
:mod:`.public`). A check uses them where ``solutions/`` is absent.

Rule that keeps the pipeline honest: a solution region sits *inside a function*, so the cell that
defines it still runs in the exercises notebook, and the first thing to fail is the check cell.
``tests/test_exercises.py`` enforces that every exercises notebook fails exactly at its check cells.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

__all__ = ["BEGIN", "END", "strip_solutions", "make_exercise_notebook", "exercise_index",
           "generate_exercises", "CHECK_HEADER", "EXERCISE_HEADING", "HIDDEN_HEADER", "HIDDEN_TAG",
           "CHECK_TAG", "CHECK_CALL", "HIDDEN_CALL", "check_hash", "definition_cells", "generate_public_cases"]

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
CHECK_TAG = "check"
SOLUTION_ONLY_TAG = "solution-only"
#: tag of a hidden check: kept in solutions/, never written to exercises/
HIDDEN_TAG = "hidden"
#: first line of a check cell: ``# Check 04.2 — what is checked``
CHECK_HEADER = re.compile(r"^#\s*Check\s+(?P<id>\d{2}\.\d+)\b[\s:—–-]*(?P<title>.*)$")
#: first line of a hidden check cell: ``# Hidden 04.2 — what else is checked``
HIDDEN_HEADER = re.compile(r"^#\s*Hidden\s+(?P<id>\d{2}\.\d+)\b[\s:—–-]*(?P<title>.*)$")
#: the call a check cell ends with, and a hidden check's
CHECK_CALL = re.compile(r"""gc\.check_exercise\(\s*["'](?P<id>\d{2}\.\d+)["']""")
HIDDEN_CALL = re.compile(r"""gc\.check_hidden\(\s*["'](?P<id>\d{2}\.\d+)["']""")
#: markdown heading that opens an exercise: ``## Exercise 04.2 — title``
EXERCISE_HEADING = re.compile(r"^#+\s*Exercise\s+(?P<id>\d{2}\.\d+)\b[\s:—–-]*(?P<title>.*)$",
                              re.MULTILINE)


class ExerciseFormatError(ValueError):
    """A solutions notebook breaks the exercise conventions (the message says where and how)."""


def strip_solutions(source: str, exercise_id: str, *, where: str = "cell") -> str:
    """Replace every ``### BEGIN SOLUTION`` … ``### END SOLUTION`` region in ``source`` by a stub.

    Example::

        >>> src = '''def double(x):
        ...     ### BEGIN SOLUTION
        ...     return 2 * x
        ...     ### END SOLUTION'''
        >>> print(strip_solutions(src, "00.1"))
        def double(x):
            # YOUR CODE HERE
            raise NotImplementedError("Exercise 00.1: replace this line with your code")
    """
    out: list[str] = []
    inside = False
    for number, line in enumerate(source.splitlines(), start=1):
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise ExerciseFormatError(f"{where}, line {number}: {BEGIN!r} inside another region")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}# YOUR CODE HERE")
            out.append(f'{indent}raise NotImplementedError("Exercise {exercise_id}: replace this '
                       'line with your code")')
        elif stripped == END:
            if not inside:
                raise ExerciseFormatError(f"{where}, line {number}: {END!r} without {BEGIN!r}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ExerciseFormatError(f"{where}: {BEGIN!r} is never closed by {END!r}")
    return "\n".join(out)


def _tags(cell) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def _has_solution(cell) -> bool:
    return cell.cell_type == "code" and any(l.strip() == BEGIN for l in cell.source.splitlines())


@dataclass
class Exercise:
    id: str
    title: str
    solution_cells: list[int]
    check_cells: list[int]
    hidden_cells: list[int] = field(default_factory=list)
    heading: int = -1                  # the markdown cell that opens the exercise


def exercise_index(nb, *, name: str = "notebook") -> dict[str, Exercise]:
    """Find every exercise of a solutions notebook and validate the conventions.

    Each ``## Exercise NN.k`` heading must be followed (before the next heading) by at least one
    solution region and exactly one check cell tagged ``check`` whose first line is
    ``# Check NN.k …``, then any number of hidden check cells tagged ``hidden`` whose first line
    is ``# Hidden NN.k …``.
    """
    exercises: dict[str, Exercise] = {}
    current: Exercise | None = None
    for index, cell in enumerate(nb.cells):
        where = f"{name}, cell {index}"
        if cell.cell_type == "markdown":
            m = EXERCISE_HEADING.search(cell.source)
            if m:
                if m["id"] in exercises:
                    raise ExerciseFormatError(f"{where}: exercise {m['id']} appears twice")
                current = Exercise(m["id"], m["title"].strip(), [], [], heading=index)
                exercises[current.id] = current
            continue
        if cell.cell_type != "code":
            continue
        first = cell.source.splitlines()[0] if cell.source else ""
        is_check = CHECK_TAG in _tags(cell)
        is_hidden, hidden = HIDDEN_TAG in _tags(cell), HIDDEN_HEADER.match(first)
        if is_hidden or hidden:
            _check_hidden_cell(cell, where, is_check, hidden, current)
            current.hidden_cells.append(index)
            continue
        header = CHECK_HEADER.match(first)
        if is_check and not header:
            raise ExerciseFormatError(f"{where}: a check cell must start with '# Check NN.k — …', "
                                      f"found {first!r}")
        if header and not is_check:
            raise ExerciseFormatError(f"{where}: starts with {first!r} but is not tagged 'check'")
        if _has_solution(cell) or is_check:
            if current is None:
                raise ExerciseFormatError(f"{where}: solution or check cell before any "
                                          "'## Exercise NN.k' heading")
            if is_check and header["id"] != current.id:
                raise ExerciseFormatError(f"{where}: check cell for {header['id']} inside exercise "
                                          f"{current.id}")
            if is_check and _has_solution(cell):
                raise ExerciseFormatError(f"{where}: a check cell must not contain a solution region")
            if is_check and [m["id"] for m in CHECK_CALL.finditer(cell.source)] != [current.id]:
                raise ExerciseFormatError(f"{where}: a check cell must call gc.check_exercise("
                                          f"{current.id!r}, …) once (the judge decides, see harness)")
            (current.check_cells if is_check else current.solution_cells).append(index)
    for ex in exercises.values():
        if not ex.solution_cells:
            raise ExerciseFormatError(f"{name}: exercise {ex.id} has no '{BEGIN}' region")
        if len(ex.check_cells) != 1:
            raise ExerciseFormatError(f"{name}: exercise {ex.id} needs exactly one check cell, "
                                      f"found {len(ex.check_cells)}")
    return exercises


def definition_cells(nb, *, name: str = "notebook", upto: str | None = None) -> list[int]:
    r"""The code cells that define what a chapter's checks need — what the judge runs of a solutions
    notebook: the set-up before the first exercise, and each exercise's cells from its heading up to
    its check (``upto``: stop before that exercise's check) — and, for the judge, the check and the
    hidden check. The cells an exercise keeps *after* its checks (a measurement to look at, a demo)
    are not needed to decide anything and are left out.

    Example::

        >>> from nbformat.v4 import new_code_cell as code, new_markdown_cell as md, new_notebook
        >>> nb = new_notebook(cells=[code("import gpucourse as gc"), md("## Exercise 99.1 — f"),
        ...     code("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION"),
        ...     code("# Check 99.1 — f\ngc.check_exercise('99.1', f, c)", metadata={"tags": ["check"]}),
        ...     code("print(f())  # a demo after the check")])
        >>> definition_cells(nb), definition_cells(nb, upto="99.1")
        ([0, 2, 3], [0, 2])
    """
    index = exercise_index(nb, name=name)
    first = min((ex.heading for ex in index.values()), default=len(nb.cells))
    keep = [i for i in range(first) if nb.cells[i].cell_type == "code"]
    for ex in index.values():
        last = max(ex.check_cells + ex.hidden_cells)
        stop = ex.check_cells[0] if ex.id == upto else last + 1
        keep += [i for i in range(ex.heading, stop) if nb.cells[i].cell_type == "code"]
        if ex.id == upto:
            break
    return keep


def _check_hidden_cell(cell, where, is_check, header, current) -> None:
    first = cell.source.splitlines()[0] if cell.source else ""
    if is_check:
        raise ExerciseFormatError(f"{where}: a cell cannot be tagged both 'check' and 'hidden'")
    if not header:
        raise ExerciseFormatError(f"{where}: a hidden check cell must start with "
                                  f"'# Hidden NN.k — …', found {first!r}")
    if HIDDEN_TAG not in _tags(cell):
        raise ExerciseFormatError(f"{where}: starts with {first!r} but is not tagged 'hidden'")
    if current is None or header["id"] != current.id or not current.check_cells:
        raise ExerciseFormatError(f"{where}: hidden check for {header['id']} inside exercise "
                                  f"{current.id if current else '(none)'}, or before its check cell")
    if _has_solution(cell):
        raise ExerciseFormatError(f"{where}: a hidden check must not contain a solution region")
    if current.hidden_cells:
        raise ExerciseFormatError(f"{where}: exercise {current.id} has a hidden check already (one per "
                                  "exercise; put more cases in it)")
    if [m["id"] for m in HIDDEN_CALL.finditer(cell.source)] != [current.id]:
        raise ExerciseFormatError(f"{where}: a hidden check must call gc.check_hidden({current.id!r}, …) once")


def make_exercise_notebook(nb, *, name: str = "notebook"):
    """The learner's version of a solutions notebook (a new notebook; ``nb`` is not modified)."""
    exercises = exercise_index(nb, name=name)
    owner = {i: ex.id for ex in exercises.values() for i in ex.solution_cells}
    out = copy.deepcopy(nb)
    _release_metadata(out, exercises, name)
    cells = []
    for index, cell in enumerate(out.cells):
        if SOLUTION_ONLY_TAG in _tags(cell) or HIDDEN_TAG in _tags(cell):
            continue
        cell.get("metadata", {}).pop("execution", None)
        if cell.cell_type == "code":
            if index in owner:
                cell.source = strip_solutions(cell.source, owner[index], where=f"{name}, cell {index}")
            cell.outputs = []
            cell.execution_count = None
        cells.append(cell)
    out.cells = cells
    return out


def check_hash(source: str) -> str:
    """Content hash of a check cell (trailing whitespace ignored), stored in the release."""
    import hashlib

    text = "\n".join(line.rstrip() for line in source.strip().splitlines())
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _release_metadata(nb, exercises: dict[str, Exercise], name: str) -> None:
    """Chapter on the notebook; id, points, hash on each check cell; the pass line in each heading."""
    chapter = next(iter(exercises))[:2] if exercises else name[:2]
    nb.metadata["gpucourse"] = {"chapter": chapter, "release": Path(name).stem}
    for ex in exercises.values():
        check = nb.cells[ex.check_cells[0]]
        points = check.metadata.get("points", 1)
        check.metadata["gpucourse"] = {"exercise": ex.id, "points": points,
                                       "hash": check_hash(check.source)}
        heading = next(c for c in nb.cells if c.cell_type == "markdown"
                       and any(h["id"] == ex.id for h in EXERCISE_HEADING.finditer(c.source)))
        if "its check cell prints" not in heading.source:
            heading.source = (heading.source.rstrip() + f"\n\nWhen your code is right, its check "
                              f"cell prints `{ex.id} passed ✓`.")


def generate_exercises(solutions_dir: str | Path, exercises_dir: str | Path, *,
                       check_only: bool = False, chapters: list[str] | None = None) -> list[Path]:
    """Write ``exercises_dir/NN_*.ipynb`` from ``solutions_dir``; return the files that changed.

    With ``check_only=True`` nothing is written: the return value lists the exercises notebooks
    that are out of date (or missing, or no longer have a solutions source). ``chapters`` (``["08"]``)
    limits both to those chapters.

    Raises:
        FileNotFoundError: ``solutions_dir`` holds no ``NN_*.ipynb`` (nothing would be checked, and
            every exercises notebook would be deleted as stale).
    """
    solutions_dir, exercises_dir = Path(solutions_dir), Path(exercises_dir)
    sources = sorted(solutions_dir.glob("[0-9][0-9]_*.ipynb"))
    if chapters:
        sources = [p for p in sources if p.name[:2] in chapters]
    if not sources:
        # Run from the wrong folder, an empty source would "pass" the check and, worse, delete
        # every exercises notebook as stale.
        raise FileNotFoundError(
            f"no solutions notebooks (NN_*.ipynb) in {str(solutions_dir.resolve())!r}; run from the "
            "course folder (where solutions/ and exercises/ are) or pass --solutions/--exercises")
    changed: list[Path] = []
    expected = set()
    for src in sources:
        nb = nbformat.read(src, as_version=4)
        text = nbformat.writes(make_exercise_notebook(nb, name=src.name)) + "\n"
        dst = exercises_dir / src.name
        expected.add(dst.name)
        if not dst.exists() or dst.read_text(encoding="utf-8") != text:
            changed.append(dst)
            if not check_only:
                exercises_dir.mkdir(parents=True, exist_ok=True)
                dst.write_text(text, encoding="utf-8")
    for stale in sorted(exercises_dir.glob("[0-9][0-9]_*.ipynb")):
        if stale.name not in expected and (not chapters or stale.name[:2] in chapters):
            changed.append(stale)
            if not check_only:
                stale.unlink()
    return changed


def generate_public_cases(solutions_dir: str | Path, exercises_dir: str | Path, *, check_only: bool = False,
                          chapters: list[str] | None = None, refresh: bool = False,
                          log=None) -> list[Path]:
    """Write ``exercises_dir/public/NN_public_cases.json`` for every chapter whose file is missing or
    out of date (all of them with ``refresh``); return the files that changed.

    A chapter's file is computed by the real judge (a :class:`.harness.JudgeProcess` on
    ``solutions_dir``: ``cases`` and ``reference`` requests with :data:`.public.PUBLIC_SEED`, the
    visible checks only, :data:`.public.MAX_CASES` cases of each); it is out of date when
    its slots are not exactly the release notebook's visible checks, a check cell's hash changed, or
    the solutions' cells it was computed from did (:func:`.public.public_problems`). Run it after
    :func:`generate_exercises` (it reads the release notebooks).

    With ``check_only=True`` nothing is written or computed: the return value lists the public files
    that are missing, out of date or stale (``log`` gets each reason).
    """
    import time

    from .public import FOLDER, build_public, public_file, public_problems, write_public

    log = log or (lambda line: None)
    solutions_dir, exercises_dir = Path(solutions_dir), Path(exercises_dir)
    sources = sorted(solutions_dir.glob("[0-9][0-9]_*.ipynb"))
    if chapters:
        sources = [p for p in sources if p.name[:2] in chapters]
    if not sources:
        raise FileNotFoundError(f"no solutions notebooks (NN_*.ipynb) in {str(solutions_dir.resolve())!r}")
    changed: list[Path] = []
    expected = set()
    for src in sources:
        chapter, release = src.name[:2], exercises_dir / src.name
        dst = public_file(exercises_dir, chapter)
        expected.add(dst.name)
        if not release.is_file():
            log(f"{dst}: its release notebook {release} is missing")
            changed.append(dst)
            continue
        nb = nbformat.read(src, as_version=4)
        problems = public_problems(dst, nb, release, name=src.name)
        for problem in problems:
            log(problem)
        if check_only:
            if problems:
                changed.append(dst)
            continue
        if problems or refresh:
            started = time.monotonic()
            doc = build_public(chapter, solutions_dir, release)
            if write_public(doc, dst):
                changed.append(dst)
            log(f"public cases of chapter {chapter}: {len(doc['slots'])} checks, "
                f"{sum(len(s['seeds']) for s in doc['slots'].values())} cases, {dst.stat().st_size:,} bytes, "
                f"{time.monotonic() - started:.1f} s")
    for stale in sorted((exercises_dir / FOLDER).glob("[0-9][0-9]_public_cases.json")):
        if stale.name not in expected and (not chapters or stale.name[:2] in chapters):
            log(f"{stale}: no solutions notebook of chapter {stale.name[:2]}")
            changed.append(stale)
            if not check_only:
                stale.unlink()
    return changed
