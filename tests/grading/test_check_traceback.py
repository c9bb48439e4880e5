"""What a failed check shows in the notebook (and so in nbgrader's feedback to students): the
judge's message under the learner's own cell — not the grading machine's paths (issue 39)."""

import os
import re
from pathlib import Path

from _grading_helpers import CHECK, SETUP
from nbformat.v4 import new_code_cell, new_notebook


def _execute(nb, solutions, cwd) -> None:
    """Run ``nb`` in a real kernel that imports this checkout's package and judges with ``solutions``."""
    from nbclient import NotebookClient

    repo = str(Path(__file__).resolve().parents[2])          # the kernel imports this checkout's package
    env = dict(os.environ, GPUCOURSE_SOLUTIONS=str(solutions),
               PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    old = dict(os.environ)
    os.environ.update(env)
    try:
        NotebookClient(nb, timeout=300, allow_errors=True, kernel_name="python3",
                       resources={"metadata": {"path": str(cwd)}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(old)


def test_a_failed_check_shows_the_judges_message_not_the_harness(tiny_release, tmp_path):
    _, solutions = tiny_release
    nb = new_notebook(cells=[new_code_cell(SETUP + "\ndef square(x):\n    return x + 1"), new_code_cell(CHECK)])
    _execute(nb, solutions, tmp_path)
    error = next(o for o in nb.cells[1].outputs if o.output_type == "error")
    shown = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(error.traceback))
    assert error.ename == "CheckFailed" and "99.1, case 1 of" in error.evalue and "hint: multiply" in error.evalue
    assert "harness.py" not in shown and "grading" not in shown, shown
    # still the traceback a learner knows, pointing at their cell (JupyterLab and nbgrader: a failed cell)
    assert "Traceback (most recent call last)" in shown and "Cell In[2], line" in shown, shown
    assert "gc.check_exercise" in shown, shown


def test_a_check_cell_that_is_not_the_courses_says_so_and_the_courses_does_not(tiny_release, tmp_path):
    """A learner's copy of the notebook older than the course (or an edited check cell): its ``run``
    meets today's cases from the course's judge, and a failure there may say nothing of the answer.
    The check says that the cell is not the course's, on a failure and on a pass; the course's own
    check cell says nothing of the kind."""
    _, solutions = tiny_release
    old_check = CHECK.replace("range(-3, 4)", "range(-2, 3)")              # an earlier release's cell
    nb = new_notebook(cells=[new_code_cell(SETUP + "\ndef square(x):\n    return x + 1"), new_code_cell(CHECK),
                             new_code_cell(old_check), new_code_cell("def square(x):\n    return x * x"),
                             new_code_cell(old_check), new_code_cell(CHECK)])
    _execute(nb, solutions, tmp_path)

    def shown(cell):
        return "\n".join(o.get("text", "") or o.get("evalue", "") for o in cell.outputs)

    note = "this check cell is not the course's current check of 99.1"
    assert "CheckFailed" in {o.get("ename") for o in nb.cells[1].outputs} and note not in shown(nb.cells[1])
    assert "CheckFailed" in {o.get("ename") for o in nb.cells[2].outputs}, nb.cells[2].outputs
    assert note in shown(nb.cells[2]) and "python -m gpucourse check" in shown(nb.cells[2]), shown(nb.cells[2])
    error = next(o for o in nb.cells[2].outputs if o.output_type == "error")
    assert "harness.py" not in "\n".join(error.traceback), error.traceback      # still the learner's cell only
    assert "99.1 passed ✓" in shown(nb.cells[4]) and note in shown(nb.cells[4]), shown(nb.cells[4])
    assert "99.1 passed ✓" in shown(nb.cells[5]) and note not in shown(nb.cells[5]), shown(nb.cells[5])
