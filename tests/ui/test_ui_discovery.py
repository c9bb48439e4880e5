"""What the browser tests read from the course, checked without a browser (these run in `make test`).

A rule that finds nothing would make a browser scenario skip or pass vacuously; these tests fail
first, saying which rule found nothing.
"""

import nbformat
import pytest
from _ui_course import (
    ROOT,
    exercises_of,
    lesson_notebooks,
    may_have_widgets,
    needed_cells,
    plot_cell,
    widget_cells,
)
from _ui_lab import make_lab_args


def _nb(*sources: str):
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])


def test_needed_cells_follow_the_names_a_cell_reads():
    nb = _nb("import gpucourse as gc\nimport torch",            # 0: binds gc, torch
             "x = torch.ones(3)",                               # 1: needs 0
             "slow = gc.measure()",                             # 2: nobody needs it
             "%matplotlib inline\ny = x * 2",                   # 3: needs 1 (magic ignored)
             "def f():\n    return y + len(x)",                 # 4: needs 3 and 1 at call time
             "x = 5",                                           # 5: rebinds x after 4
             "w = gc.amdahl_widget(0.1, 8)\nw.summary\nf()")    # 6: needs 0 and 4 (-> 3 -> 1 -> 0)
    assert needed_cells(nb, 6) == [0, 1, 3, 4, 6]
    assert needed_cells(nb, 1) == [0, 1]
    assert needed_cells(nb, 0) == [0]
    assert widget_cells(nb) == [6]


def test_a_cell_magic_binds_nothing_in_the_kernel():
    nb = _nb("import gpucourse as gc\nimport torch",            # 0: binds gc, torch
             "x = torch.ones(3)",                               # 1: binds x
             "%%ranks\nx = torch.zeros(2)",                      # 2: x on the ranks, not here
             "w = gc.amdahl_widget(0.1, 8)\nx")                  # 3: needs 1 (and 0), never 2
    assert needed_cells(nb, 3) == [0, 1, 3]


def test_widget_cells_are_found_in_code_or_frozen_outputs_never_in_prose():
    nb = _nb("import ipywidgets as widgets\nwidgets.IntSlider()",
             "from ipywidgets import interact\ninteract(print, x=3)",
             "explorer = gc.memory_explorer(max_batch=8)",
             "print('gc.amdahl_widget is described in the text')",
             "gc.plot_amdahl([0.1])")
    nb.cells.append(nbformat.v4.new_markdown_cell("The explorer below: `gc.tp_comm_widget(...)`"))
    frozen = nbformat.v4.new_code_cell("make_view()")
    frozen.outputs = [nbformat.v4.new_output("display_data", data={
        "text/plain": "▶ run this cell for the interactive explorer (sliders: n = 4)"})]
    nb.cells.append(frozen)
    assert widget_cells(nb) == [0, 1, 2, 6]


def test_the_course_has_explorers_and_each_needs_only_earlier_cells():
    found = {}
    for path in lesson_notebooks():
        nb = nbformat.read(path, as_version=4)
        cells = widget_cells(nb)
        if cells:
            assert may_have_widgets(path), path.name      # the grep used to parametrize sees it too
            found[path.name[:2]] = cells
            for c in cells:
                run = needed_cells(nb, c)
                assert run[-1] == c and all(nb.cells[i].cell_type == "code" for i in run)
    assert {"01", "03"} <= set(found), f"explorers found: {found}"


def test_a_plot_only_cell_is_found():
    found = plot_cell(lesson_notebooks())
    assert found is not None, "no lesson cell only draws with gc.plot_* (scenario 3 would skip)"
    path, index, run = found
    nb = nbformat.read(path, as_version=4)
    assert run[-1] == index and "gc.plot_" in nb.cells[index].source


@pytest.mark.parametrize("path", sorted((ROOT / "exercises").glob("[0-9][0-9]_*_exercises.ipynb")),
                         ids=lambda p: p.name[:2])
def test_every_exercise_stub_maps_to_its_solution_and_check(path):
    exercises = exercises_of(path, ROOT / "solutions" / path.name)
    nb = nbformat.read(path, as_version=4)
    assert exercises
    for ex in exercises:
        assert nb.cells[ex.check_cell].source.startswith(f"# Check {ex.id}")
        for stub in ex.stubs:
            assert stub.cell < ex.check_cell
            assert f'raise NotImplementedError("Exercise {ex.id}' in nb.cells[stub.cell].source
            assert "# YOUR CODE HERE" not in stub.solved and "### BEGIN" not in stub.solved


def test_the_server_gets_make_labs_default_url_and_settings():
    args = make_lab_args()
    assert args["default_url"] == "/lab/tree/notebooks/00_setup.ipynb"
    assert args["app_settings_dir"].endswith("LAB_SETTINGS)")
    assert (ROOT / "lab" / "settings" / "overrides.json").is_file()


def test_the_course_lab_settings_disable_nbgrader_instructor_tools():
    """The lab `make lab` (and the browser tests) start reads lab/settings: nbgrader's lab extension —
    its Nbgrader menu, Create Assignment panel and Validate button — is disabled there, while the
    nbgrader command line (the export's round trip in make test) stays installed (issue 39)."""
    import sys
    from pathlib import Path

    from jupyterlab_server.config import get_page_config

    assert make_lab_args()["app_settings_dir"] == "$(LAB_SETTINGS)"
    assert "LAB_SETTINGS := $(CURDIR)/lab/settings" in (ROOT / "Makefile").read_text()
    config = get_page_config([], app_settings_dir=str(ROOT / "lab" / "settings"))
    assert "@jupyter/nbgrader" in config["disabledExtensions"], config["disabledExtensions"]
    assert (Path(sys.executable).parent / "nbgrader").exists()
