"""Generate a class of cheating, broken and honest submissions from the shipped exercises.

    python tests/grading/make_corpus.py DEST       # writes DEST/<student>/<notebook>.ipynb

Every submission is built from ``exercises/`` and ``solutions/`` as they are today, so the corpus
follows the course. :data:`EXPECTED` says what a correct grader must give each student.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell

ROOT = Path(__file__).resolve().parents[2]
CH00 = "00_setup_exercises.ipynb"
CH03 = "03_balanced_data_parallel_exercises.ipynb"
STUB = 'raise NotImplementedError("Exercise'
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


def _answers(name: str) -> list[str]:
    """The solutions' answer cells of a chapter, markers removed, in order."""
    nb = nbformat.read(ROOT / "solutions" / name, as_version=4)
    out = []
    for cell in nb.cells:
        if cell.cell_type == "code" and BEGIN in cell.source:
            out.append("\n".join(l for l in cell.source.splitlines() if l.strip() not in (BEGIN, END)))
    return out


def exercises(name: str = CH00):
    return nbformat.read(ROOT / "exercises" / name, as_version=4)


def solved(name: str = CH00, only: set[int] | None = None):
    """The exercises notebook with the solutions' answers filled in (all, or the k-th in ``only``)."""
    nb = exercises(name)
    answers = iter(enumerate(_answers(name)))
    for cell in nb.cells:
        if cell.cell_type == "code" and STUB in cell.source:
            k, answer = next(answers)
            if only is None or k in only:
                cell.source = answer
    return nb


def _checks(nb):
    return [c for c in nb.cells if c.cell_type == "code" and "check" in c.metadata.get("tags", [])]


def _insert_after_imports(nb, source):
    nb.cells.insert(2, new_code_cell(source))
    return nb


def corpus() -> dict[str, tuple[str, object]]:
    """student → (file name, notebook or raw bytes)."""
    c: dict[str, tuple[str, object]] = {}
    c["honest"] = (CH00, solved())

    nb = exercises()
    for cell in _checks(nb):
        cid = cell.source.split()[2]
        cell.source = cell.source.splitlines()[0] + f'\nprint("{cid} passed ✓")'
    c["fake_checks"] = (CH00, nb)

    nb = solved(only={1})                               # 00.2 solved; 00.1's check deleted, 00.3 unsolved
    nb.cells.remove(_checks(nb)[0])
    c["deleted_check"] = (CH00, nb)

    nb = exercises()
    c["custom_exc"] = (CH00, _insert_after_imports(
        nb, "get_ipython().set_custom_exc((Exception,), lambda *a, **k: None)"))

    nb = exercises()
    c["noop_assert_close"] = (CH00, _insert_after_imports(nb, "import torch\n"
                                                          "torch.testing.assert_close = lambda *a, **k: None"))

    nb = solved(only={0})                               # 00.2 is wrong, and its old reference is rebound
    c["rebind_gc"] = (CH00, _insert_after_imports(
        nb, "import gpucourse as gc\ngc.visible_devices = lambda spec: {}\n"
            "def physical_gpu(spec, logical):\n    raise IndexError(logical)"))

    nb = exercises()
    c["input_transformer"] = (CH00, _insert_after_imports(
        nb, "def _skip_checks(lines):\n"
            "    return ['pass\\n'] if lines and lines[0].startswith('# Check') else lines\n"
            "get_ipython().input_transformers_cleanup.append(_skip_checks)"))

    nb = exercises()
    c["excepthook"] = (CH00, _insert_after_imports(
        nb, "import sys\nsys.excepthook = lambda *a: None\nget_ipython().showtraceback = lambda *a, **k: None"))

    nb = solved()                                       # moved: every answer in one new cell, up top
    answers = [c2.source for c2 in nb.cells if c2.cell_type == "code" and c2.source.startswith(
        ("def mean_over_ranks", "def physical_gpu", "def launch_plan"))]
    rest = []
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source in answers:
            lines = cell.source.split("\n\n\n", 1)      # keep helpers that follow the answer in place
            cell.source = lines[1] if len(lines) > 1 else "# (moved up)"
        rest.append(cell)
    nb.cells = rest
    nb.cells.insert(2, new_code_cell("# my answers\n" + "\n\n".join(a.split("\n\n\n", 1)[0] for a in answers),
                                     metadata={"tags": ["mine"]}))
    for cell in nb.cells:
        cell["id"] = "renamed-" + cell.get("id", "x")
    c["moved_answers"] = (CH00, nb)

    nb = solved()                                       # sections in another order
    heads = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "markdown" and "## Exercise" in cell.source]
    first, second = nb.cells[heads[0]:heads[1]], nb.cells[heads[1]:]
    nb.cells = nb.cells[:heads[0]] + second + first
    c["reordered"] = (CH00, nb)

    c["other_chapter"] = (CH00, solved(CH03))
    c["truncated"] = (CH00, nbformat.writes(solved()).encode()[:2000])
    c["not_a_notebook"] = (CH00, b'{"hello": "world"}')
    c["binary"] = (CH00, b"\x89PNG\r\n\x1a\n\x00\x00")
    return c


#: student → (points of 4, status, flags that must appear in "restored" or "error")
EXPECTED = {
    "honest": (4, "graded", []),
    "fake_checks": (0, "graded", ["edited"]),
    "deleted_check": (1, "graded", ["deleted"]),
    "custom_exc": (0, "graded", []),
    "noop_assert_close": (0, "graded", ["not implemented yet"]),
    "rebind_gc": (1, "graded", []),                  # 00.1 solved: rebinding a gc helper costs nothing else
    "input_transformer": (0, "graded", ["sent no values"]),
    "excepthook": (0, "graded", []),
    "moved_answers": (4, "graded", []),
    "reordered": (4, "graded", []),
    "other_chapter": (0, "wrong chapter", ["wrong chapter"]),
    "truncated": (0, "unreadable", ["not valid JSON"]),
    "not_a_notebook": (0, "unreadable", ["not a Jupyter notebook"]),
    "binary": (0, "unreadable", ["not UTF-8"]),
}


def write(dest: str | Path) -> dict[str, Path]:
    dest = Path(dest)
    paths = {}
    for student, (name, nb) in corpus().items():
        folder = dest / student
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        if isinstance(nb, bytes):
            path.write_bytes(nb)
        else:
            nbformat.write(copy.deepcopy(nb), path)
        paths[student] = path
    return paths


if __name__ == "__main__":
    for student, path in write(sys.argv[1] if len(sys.argv) > 1 else "corpus").items():
        print(f"{student:20s} {path}")
