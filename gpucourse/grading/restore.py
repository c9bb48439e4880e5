"""The checks come from the course, never from the submission.

A submitted notebook is matched to its release notebook (``exercises/NN_*.ipynb``) by chapter, and
the notebook that actually runs is rebuilt from both::

    submission cells ──►  drop cells tagged ``hidden`` / starting ``# Hidden``
                     ──►  every check cell (by exercise id NN.k: tag ``check``, ``# Check NN.k``
                          header, or our metadata) gets the release's source and metadata back,
                          less the functions only the judge calls (``graded_build.kernel_code``:
                          an answer could call them); a hash mismatch is reported as "edited —
                          restored"
                     ──►  a deleted check cell is put back after its exercise's last cell
                          (its ``## Exercise NN.k`` section), or after the student's copy of the
                          release cell that preceded it, or at the end
                     ──►  with ``hidden``: a grader's cell right after it that runs the hidden
                          cases of NN.k (the judge holds them; their source never enters the run)

Only the slots recorded in :class:`Slot` are graded; other cells that look like checks (a second
``# Check 00.1`` cell, a made-up ``# Check 99.9``) are ordinary cells of the submission. An exercise
whose id appears nowhere in the submission scores 0 and is listed as missing.

.. warning::
   The chapter of a submission is read from its content (exercise ids), not trusted from its
   file name or metadata; a file named ``00_…`` whose exercises are chapter 03 is "wrong chapter".
"""

from __future__ import annotations

import copy
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from .exercises import CHECK_HEADER, CHECK_TAG, EXERCISE_HEADING, HIDDEN_HEADER, HIDDEN_TAG, check_hash
from .graded_build import kernel_code

__all__ = [
    "HIDDEN_HEADER",
    "NotANotebook",
    "Release",
    "ReleaseCheck",
    "Slot",
    "chapter_of",
    "load_hidden",
    "load_release",
    "load_releases",
    "restore",
]

_ID_ANYWHERE = re.compile(r"\b(\d{2}\.\d+)\b")


class NotANotebook(ValueError):
    """The bytes are not a readable notebook (the message says why, in one line)."""


@dataclass
class ReleaseCheck:
    id: str
    title: str
    source: str
    hash: str
    points: float
    index: int              # position in the release notebook


@dataclass
class Release:
    path: Path
    chapter: str
    nb: object
    checks: dict[str, ReleaseCheck]         # in release order


@dataclass
class Slot:
    """A graded cell of the run notebook."""

    id: str
    title: str
    kind: str               # "visible" or "hidden"
    points: float
    key: str = ""           # the judge's slot: "08.1" or "08.1/hidden"
    index: int = -1         # position in the run notebook (filled at the end)
    edited: bool = False    # the submission's copy differed from the release
    deleted: bool = False   # the submission had no check cell for this id: put back
    missing: bool = False   # the id appears nowhere in the submission: scores 0
    source: str = ""
    extra: dict = field(default_factory=dict)


def parse_notebook(data: bytes, name: str = "notebook"):
    """Bytes → notebook, or :class:`NotANotebook` with a one-line reason."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NotANotebook(f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise NotANotebook("empty file")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise NotANotebook(f"not valid JSON (truncated or corrupted): {e.msg} (line {e.lineno}, "
                           f"column {e.colno})") from None
    if not isinstance(raw, dict) or "cells" not in raw or "nbformat" not in raw:
        raise NotANotebook("JSON, but not a Jupyter notebook (no 'cells'/'nbformat')")
    try:
        nb = nbformat.reads(text, as_version=4)
    except Exception as e:  # nbformat raises several kinds on odd notebooks
        raise NotANotebook(f"not a readable notebook: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    for cell in nb.cells:
        if not isinstance(cell.get("source", ""), str) or cell.get("cell_type") not in (
                "code", "markdown", "raw"):
            raise NotANotebook("a cell has no valid type or source")
    return nb


def _tags(cell) -> list[str]:
    tags = cell.get("metadata", {}).get("tags", [])
    return [t for t in tags if isinstance(t, str)] if isinstance(tags, list) else []


def _first_line(cell) -> str:
    return cell.source.lstrip().splitlines()[0] if cell.source.strip() else ""


def load_release(path: str | Path, nb=None) -> Release:
    """Read one release notebook (``exercises/NN_*.ipynb`` written by ``make exercises``).

    With ``nb`` given, that notebook is the release (a notebook that is not part of the course is
    checked against its own check cells).
    """
    path = Path(path)
    nb = nbformat.read(path, as_version=4) if nb is None else nb
    checks: dict[str, ReleaseCheck] = {}
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or CHECK_TAG not in _tags(cell):
            continue
        m = CHECK_HEADER.match(_first_line(cell))
        if not m:
            continue
        meta = cell.metadata.get("gpucourse", {})
        checks[m["id"]] = ReleaseCheck(m["id"], m["title"].strip(), cell.source,
                                       meta.get("hash") or check_hash(cell.source),
                                       float(meta.get("points", 1)), index)
    chapter = nb.metadata.get("gpucourse", {}).get("chapter") or (
        next(iter(checks))[:2] if checks else path.name[:2])
    return Release(path, chapter, nb, checks)


def load_releases(folder: str | Path) -> dict[str, Release]:
    """Every ``NN_*.ipynb`` of a release folder (or one notebook), by chapter."""
    folder = Path(folder)
    paths = [folder] if folder.is_file() else sorted(folder.glob("[0-9][0-9]_*.ipynb"))
    releases = {}
    for p in paths:
        r = load_release(p)
        releases[r.chapter] = r
    return releases


def load_hidden(folder: str | Path) -> dict[str, list[tuple[str, str]]]:
    """Hidden checks of ``solutions/``: exercise id → [(title, source)], in notebook order."""
    hidden: dict[str, list[tuple[str, str]]] = {}
    for p in sorted(Path(folder).glob("[0-9][0-9]_*.ipynb")):
        for cell in nbformat.read(p, as_version=4).cells:
            m = HIDDEN_HEADER.match(_first_line(cell)) if cell.cell_type == "code" else None
            if m and HIDDEN_TAG in _tags(cell):
                hidden.setdefault(m["id"], []).append((m["title"].strip(), cell.source))
    return hidden


def _ids_in(nb) -> list[str]:
    """Exercise ids the submission itself names (headings, check headers, stub messages)."""
    ids = []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            ids += [m["id"] for m in EXERCISE_HEADING.finditer(cell.source)]
        elif cell.cell_type == "code":
            m = CHECK_HEADER.match(_first_line(cell))
            if m:
                ids.append(m["id"])
    return ids


def chapter_of(nb, filename: str = "") -> tuple[str | None, str | None]:
    """(chapter from the content's exercise ids, chapter from the file name), each may be None."""
    ids = _ids_in(nb)
    content = Counter(i[:2] for i in ids).most_common(1)[0][0] if ids else None
    m = re.match(r"(\d{2})_", Path(filename).name)
    return content, (m[1] if m else None)


def _check_id(cell) -> str | None:
    if cell.cell_type != "code":
        return None
    m = CHECK_HEADER.match(_first_line(cell))
    if m:
        return m["id"]
    meta = cell.get("metadata", {}).get("gpucourse", {})
    if CHECK_TAG in _tags(cell) and isinstance(meta, dict) and isinstance(meta.get("exercise"), str):
        return meta["exercise"]
    return None


def _neutral_metadata(cell) -> None:
    """A student's cell runs as an ordinary cell: no tags or metadata that change how it runs."""
    cell.metadata = {}


def hidden_cell_source(exercise: str) -> str:
    """The grader's cell that runs exercise ``exercise``'s hidden cases (with its check's own code)."""
    return f"__import__('gpucourse.grading.harness', fromlist=['run_hidden']).run_hidden({exercise!r})"


def restore(sub, release: Release, *, hidden: dict[str, str] | None = None
            ) -> tuple[object, list[Slot], list[int | None]]:
    """Build the notebook to run from a submission and its release.

    ``hidden`` maps an exercise id to its hidden check's title: a cell that runs those cases goes
    right after the exercise's check. Returns ``(run_nb, slots, origin)``: the notebook, the graded cells, and for every run cell
    its index in the submission (``None`` for a cell the grader put there).
    """
    cells = []
    origin: list[int | None] = []
    for i, cell in enumerate(sub.cells):
        if cell.cell_type == "code" and (HIDDEN_TAG in _tags(cell)
                                         or HIDDEN_HEADER.match(_first_line(cell))):
            continue                                    # only the course supplies hidden checks
        cell = copy.deepcopy(cell)
        cells.append(cell)
        origin.append(i)
    mentioned = set(_ID_ANYWHERE.findall("\n".join(c.source for c in sub.cells)))

    taken: dict[str, int] = {}
    for pos, cell in enumerate(cells):
        cid = _check_id(cell)
        if cid in release.checks and cid not in taken:
            taken[cid] = pos
    marker = "_gpucourse_slot"
    for cell in cells:
        if cell.cell_type == "code":
            _neutral_metadata(cell)
            cell.outputs, cell.execution_count = [], None
        else:                                   # a forged slot marker on a markdown cell: not a slot
            cell.get("metadata", {}).pop(marker, None)

    slots: list[Slot] = []
    for cid, rc in release.checks.items():
        slot = Slot(cid, rc.title, "visible", rc.points, cid)
        slot.missing = cid not in mentioned
        # the kernel runs the check without what only the judge calls (an answer could call it)
        new = nbformat.v4.new_code_cell(kernel_code(rc.source), metadata={"tags": [CHECK_TAG], marker: cid})
        if cid in taken:
            old = cells[taken[cid]]
            slot.edited = check_hash(old.source) != rc.hash
            cells[taken[cid]] = new
        else:
            slot.deleted = True
            at = _insertion_point(cells, cid, release)
            cells.insert(at, new)
            origin.insert(at, None)
            taken = {k: (v + 1 if v >= at else v) for k, v in taken.items()}
        slots.append(slot)
        if cid in (hidden or {}):
            slots.append(Slot(cid, hidden[cid], "hidden", rc.points, f"{cid}/hidden"))
            at = next(p for p, c in enumerate(cells) if c.metadata.get(marker) == cid) + 1
            cells.insert(at, nbformat.v4.new_code_cell(hidden_cell_source(cid),
                                                       metadata={"tags": ["hidden"], marker: cid}))
            origin.insert(at, None)
            taken = {k: (v + 1 if v >= at else v) for k, v in taken.items()}

    # positions, in run order
    by_id: dict[str, list[Slot]] = {}
    for s in slots:
        by_id.setdefault(s.id, []).append(s)
    seen: Counter = Counter()
    for pos, cell in enumerate(cells):
        cid = cell.metadata.get(marker)
        if cid is None:
            continue
        slot = by_id[cid][seen[cid]]
        seen[cid] += 1
        slot.index, slot.source = pos, cell.source
        del cell.metadata[marker]
    run = nbformat.v4.new_notebook(cells=cells, metadata={"gpucourse": {"chapter": release.chapter}})
    return run, slots, origin


def _insertion_point(cells, cid: str, release: Release) -> int:
    """Where a deleted check goes: end of its exercise section, else after the release's previous
    cell's counterpart, else the end."""
    start, level = None, 0
    for pos, cell in enumerate(cells):
        if cell.cell_type != "markdown":
            continue
        if start is None:
            m = next((m for m in EXERCISE_HEADING.finditer(cell.source) if m["id"] == cid), None)
            if m:
                start, level = pos, len(m.group(0)) - len(m.group(0).lstrip("#"))
            continue
        heading = re.match(r"^(#+)\s", cell.source.lstrip())
        if heading and len(heading[1]) <= level:        # the next section at the same level or above
            return pos
    if start is not None:
        return len(cells)
    rc = release.checks[cid]
    before = [c for c in release.nb.cells[:rc.index] if c.cell_type == "code"]
    if before:
        head = _first_line(before[-1])
        for pos in range(len(cells) - 1, -1, -1):
            if head and _first_line(cells[pos]) == head:
                return pos + 1
    return len(cells)
