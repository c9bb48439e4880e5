"""What a failed check shows in the notebook (and so in nbgrader's feedback to students): the
judge's message under the learner's own cell — not the grading machine's paths (issue 39)."""

import os
import re
from pathlib import Path

from _grading_helpers import CHECK, SETUP
from nbformat.v4 import new_code_cell, new_notebook


def test_a_failed_check_shows_the_judges_message_not_the_harness(tiny_release, tmp_path):
    from nbclient import NotebookClient

    _, solutions = tiny_release
    nb = new_notebook(cells=[new_code_cell(SETUP + "\ndef square(x):\n    return x + 1"), new_code_cell(CHECK)])
    repo = str(Path(__file__).resolve().parents[2])          # the kernel imports this checkout's package
    env = dict(os.environ, GPUCOURSE_SOLUTIONS=str(solutions),
               PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    old = dict(os.environ)
    os.environ.update(env)
    try:
        NotebookClient(nb, timeout=300, allow_errors=True, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(old)
    error = next(o for o in nb.cells[1].outputs if o.output_type == "error")
    shown = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(error.traceback))
    assert error.ename == "CheckFailed" and "99.1, case 1 of" in error.evalue and "hint: multiply" in error.evalue
    assert "harness.py" not in shown and "grading" not in shown, shown
    # still the traceback a learner knows, pointing at their cell (JupyterLab and nbgrader: a failed cell)
    assert "Traceback (most recent call last)" in shown and "Cell In[2], line" in shown, shown
    assert "gc.check_exercise" in shown, shown
