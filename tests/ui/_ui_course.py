"""What the browser tests look for in the course, read from the notebooks themselves (no browser).

Nothing here is a hard-coded list of chapters: a new chapter with a widget, a plot or an exercise
is picked up by the same rules.

* widget cells: a stored frozen explorer (the placeholder ``scripts/execute_notebooks.py`` writes),
  or source that builds a widget (``ipywidgets``, ``interact(...)``, a ``gc.…widget(...)`` /
  ``gc.…explorer(...)`` helper);
* the cells a cell needs: the earlier cells that bind the names it reads, transitively (a learner
  who scrolls to an explorer runs the imports cell, then the explorer);
* exercises: each stub cell of ``exercises/NN_*.ipynb`` with the solution text that completes it
  (``solutions/``, between ``### BEGIN SOLUTION`` and ``### END SOLUTION``) and its check cell.
"""

from __future__ import annotations

import ast
import builtins
import json
import re
from dataclasses import dataclass
from pathlib import Path

import nbformat

from gpucourse.grading.exercises import BEGIN, CHECK_HEADER, END, exercise_index, strip_solutions

ROOT = Path(__file__).resolve().parents[2]
#: first words of the stored output of a frozen widget cell (scripts/execute_notebooks.py)
PLACEHOLDER = "run this cell for the interactive explorer"
WIDGET_SOURCE = re.compile(r"\bipywidgets\b|\binteract(?:ive)?\s*\(|\bgc\.\w*(?:widget|explorer)\s*\(")
PLOT_SOURCE = re.compile(r"\bgc\.plot_\w+\s*\(")


def lesson_notebooks(root: Path = ROOT) -> list[Path]:
    return sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def code_cells(nb) -> list[int]:
    return [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]


def is_widget_cell(cell) -> bool:
    if cell.cell_type != "code":
        return False
    if any(PLACEHOLDER in json.dumps(o, ensure_ascii=False) for o in cell.get("outputs", [])):
        return True
    return bool(WIDGET_SOURCE.search(cell.source))


def widget_cells(nb) -> list[int]:
    return [i for i, c in enumerate(nb.cells) if is_widget_cell(c)]


def may_have_widgets(path: Path) -> bool:
    """Cheap text test (a grep) used to parametrize; the test itself looks at the cells."""
    text = path.read_text(encoding="utf-8")
    return PLACEHOLDER in text or bool(WIDGET_SOURCE.search(text))


def _parse(source: str) -> ast.Module | None:
    if source.lstrip().startswith("%%"):
        return None      # a cell magic (%%ranks): its body does not run in the kernel's namespace
    # IPython line magics and shell escapes are not Python: blank them out
    lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return None


def _bound_and_read(source: str) -> tuple[set[str], set[str]]:
    """(names a cell binds at top level, names it reads that it has not bound itself)."""
    tree = _parse(source)
    if tree is None:
        return set(), set()
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    # names bound in the cell (or inside its functions) are not needed from earlier cells; a name a
    # function reads at call time may come from an earlier cell, so those count as read
    return bound, read - bound - set(dir(builtins))


def needed_cells(nb, target: int) -> list[int]:
    """The code cells to run, in order, so that cell ``target`` has every name it reads."""
    cells = nb.cells
    info = {i: _bound_and_read(cells[i].source) for i in code_cells(nb) if i <= target}
    chosen = {target}
    todo = [target]
    while todo:
        i = todo.pop()
        for name in info[i][1]:
            binder = next((j for j in sorted(info, reverse=True) if j < i and name in info[j][0]), None)
            if binder is not None and binder not in chosen:
                chosen.add(binder)
                todo.append(binder)
    return sorted(chosen)


def plot_cell(paths: list[Path]) -> tuple[Path, int, list[int]] | None:
    """The first lesson cell that only draws (``gc.plot_*(...)`` and ``plt.*(...)`` calls, nothing
    measured), has a stored image and needs nothing before it but the notebook's setup cell (its
    first code cell) or import cells: (notebook, cell index, cells to run)."""
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        for i in code_cells(nb):
            cell = nb.cells[i]
            if is_widget_cell(cell) or not _only_drawing(cell.source):
                continue
            if not any("image/png" in o.get("data", {}) for o in cell.outputs):
                continue
            run = needed_cells(nb, i)
            if all(j == code_cells(nb)[0] or _only_imports(nb.cells[j].source) for j in run[:-1]):
                return path, i, run
    return None


def _only_drawing(source: str) -> bool:
    tree = _parse(source)
    if tree is None or not PLOT_SOURCE.search(source):
        return False
    return all(isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
               and isinstance(s.value.func, ast.Attribute) and isinstance(s.value.func.value, ast.Name)
               and s.value.func.value.id in ("gc", "plt") for s in tree.body)


def _only_imports(source: str) -> bool:
    tree = _parse(source)
    return tree is not None and all(
        isinstance(s, (ast.Import, ast.ImportFrom)) for s in tree.body)


@dataclass
class Stub:
    cell: int             # index in the exercises notebook
    source: str           # as shipped: the stub lines in place of the solution
    solved: str           # the solution's cell without its BEGIN/END marker lines


@dataclass
class Exercise:
    id: str
    stubs: list[Stub]     # the cells the learner completes (usually one)
    check_cell: int       # index of its check cell in the exercises notebook


def exercises_of(exercises_nb: Path, solutions_nb: Path) -> list[Exercise]:
    """Every exercise of an exercises notebook, in notebook order, with its stubs' solutions."""
    ex_nb = nbformat.read(exercises_nb, as_version=4)
    sol_nb = nbformat.read(solutions_nb, as_version=4)
    out = []
    for ex in exercise_index(sol_nb, name=solutions_nb.name).values():
        stubs = []
        for s in ex.solution_cells:
            source = sol_nb.cells[s].source
            stub = strip_solutions(source, ex.id)
            cell = next((i for i, c in enumerate(ex_nb.cells) if c.cell_type == "code"
                         and c.source == stub), None)
            if cell is None:
                raise LookupError(f"{exercises_nb.name}: no stub cell for exercise {ex.id} "
                                  "(regenerate exercises/: python -m gpucourse exercises)")
            solved = "\n".join(line for line in source.splitlines() if line.strip() not in (BEGIN, END))
            stubs.append(Stub(cell, stub, solved))
        check_cell = next((i for i, c in enumerate(ex_nb.cells) if c.cell_type == "code"
                           and (m := CHECK_HEADER.match(c.source.split("\n", 1)[0])) and m["id"] == ex.id),
                          None)
        if check_cell is None:
            raise LookupError(f"{exercises_nb.name}: no check cell for exercise {ex.id}")
        out.append(Exercise(ex.id, stubs, check_cell))
    return sorted(out, key=lambda e: e.check_cell)
