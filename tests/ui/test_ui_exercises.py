"""An exercises notebook as a learner meets it in JupyterLab (issue 19, scenarios 4 and 5).

4. Stubs, instructions and check cells with no stale output; a check run on the stub shows
   ``NotImplementedError`` naming the exercise; the solution's code (from ``solutions/``, between
   the ``### BEGIN SOLUTION`` / ``### END SOLUTION`` markers) pasted into the stub makes the check
   print ``passed ✓``.
5. After saving, ``gc.check_this_notebook()`` in a new cell prints its table.

Both work on the same page, in turn (a learner's session); the notebook is the first chapter's.
"""

from __future__ import annotations

import re

import pytest
from _ui_course import ROOT, exercises_of
from _ui_lab import close_notebook, open_notebook

pytestmark = [pytest.mark.ui, pytest.mark.timeout(900)]

EXERCISES = min((ROOT / "exercises").glob("[0-9][0-9]_*_exercises.ipynb"))
SOLUTIONS = ROOT / "solutions" / EXERCISES.name
solved: set[str] = set()          # exercises scenario 4 completed in the page (scenario 5 reads it)


@pytest.fixture(scope="module")
def exercises_page(browser, lab):
    path = f"exercises/{EXERCISES.name}"
    nbp = open_notebook(browser, lab, path)
    yield nbp, exercises_of(EXERCISES, SOLUTIONS)
    close_notebook(nbp)
    lab.restore(path)             # the lessons (chapter 00 checks this notebook) see it unsolved


def test_exercise_stub_fails_with_its_id_and_the_pasted_solution_passes(exercises_page):
    nbp, exercises = exercises_page
    assert exercises, f"{EXERCISES.name} has no exercises"
    headings = " ".join(nbp.panel.locator(".jp-RenderedMarkdown").all_text_contents())
    for ex in exercises:
        # what the learner sees before running anything
        assert re.search(rf"Exercise {re.escape(ex.id)}\b", headings), f"no rendered heading for {ex.id}"
        assert f"{ex.id} passed ✓" in headings, f"the instructions of {ex.id} do not say what a pass prints"
        for stub in ex.stubs:
            text = nbp.editor_text(stub.cell)
            assert "# YOUR CODE HERE" in text and f'NotImplementedError("Exercise {ex.id}' in text, text
        check = nbp.cell(ex.check_cell)
        assert nbp.prompt(ex.check_cell) == "[ ]:", f"check {ex.id} has a stale count"
        assert check.locator(".jp-OutputArea-output").count() == 0, f"check {ex.id} has stale output"

    done = -1                                       # the cells run so far, from the top
    for ex in exercises:
        for i in nbp.code_cells():
            if done < i < ex.check_cell:
                nbp.run(i)
        done = ex.check_cell
        nbp.run(ex.check_cell)
        errors = nbp.error_outputs(ex.check_cell)
        assert errors and any("NotImplementedError" in e and f"Exercise {ex.id}" in e for e in errors), (
            f"check {ex.id} on the stub should show NotImplementedError naming {ex.id}; it shows "
            f"{nbp.output_text(ex.check_cell)[-1500:]!r}")

        for stub in ex.stubs:
            nbp.paste_into(stub.cell, stub.solved)
            assert nbp.editor_text(stub.cell).strip() == stub.solved.strip(), "the paste did not land as is"
            nbp.run(stub.cell)
        out = nbp.run(ex.check_cell)
        assert f"{ex.id} passed ✓" in out and not nbp.error_outputs(ex.check_cell), (
            f"check {ex.id} with the solution pasted in: {out[-1500:]!r}")
        solved.add(ex.id)


def test_check_this_notebook_prints_its_table(exercises_page):
    nbp, exercises = exercises_page
    nbp.save()                                      # the check reads the saved file
    cell = nbp.append_code_cell("gc.check_this_notebook()")
    out = nbp.run(cell, timeout_s=600)
    lines = out.splitlines()
    assert any(EXERCISES.name in line for line in lines), out
    for ex in exercises:
        mark = "✓" if ex.id in solved else "[✓✗]"
        assert any(re.match(rf"\s*{re.escape(ex.id)}\s+{mark}\s", line) for line in lines), (
            f"no row {mark} for {ex.id} in the table: {out!r}")
    summary = re.search(r"(\d+) of (\d+) checks pass", out)
    assert summary and int(summary[2]) >= len(exercises), out
    assert int(summary[1]) >= len(solved), out


def test_the_learners_lab_shows_no_nbgrader_instructor_tools(exercises_page):
    """nbgrader comes with the test extra into the one .venv; the course's lab settings
    (lab/settings/page_config.json) keep its instructor tools out of the learner's lab (issue 39)."""
    nbp, _ = exercises_page
    page = nbp.page
    menus = " ".join(page.locator(".lm-MenuBar-itemLabel").all_text_contents())
    assert "File" in menus and "Kernel" in menus, menus            # the menu bar was read
    assert "Nbgrader" not in menus, menus
    tabs = " ".join(page.locator(".lm-TabBar-tab").evaluate_all(
        "els => els.map(e => (e.getAttribute('title') || '') + ' ' + (e.getAttribute('data-id') || ''))"))
    assert "nbgrader" not in tabs.lower() and "Create Assignment" not in tabs, tabs
    toolbar = " ".join(nbp.panel.locator(".jp-Toolbar-item").evaluate_all(
        "els => els.map(e => e.textContent + ' ' + (e.getAttribute('title') || ''))"))
    assert "Validate" not in toolbar, toolbar
