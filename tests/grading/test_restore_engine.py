"""Units of the grader: reading submissions, restoring checks, priming and collecting, output cap."""

import json

import nbformat
import pytest
from _grading_helpers import TINY
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from gpucourse.grading.engine import execute
from gpucourse.grading.graded_build import kernel_code
from gpucourse.grading import wire
from gpucourse.grading.restore import NotANotebook, chapter_of, load_release, parse_notebook, restore


@pytest.fixture
def release(tiny_release):
    return load_release(tiny_release[0] / TINY)


def _sub(release, mutate=lambda cells: None):
    nb = nbformat.from_dict(nbformat.from_dict(release.nb))
    nb = nbformat.reads(nbformat.writes(nb), as_version=4)
    mutate(nb.cells)
    return nb


@pytest.mark.parametrize("data, why", [
    (b"", "empty"), (b"\xff\xfe", "not UTF-8"), (b'{"cells": [', "not valid JSON"),
    (b"[1, 2]", "not a Jupyter notebook"), (b'{"cells": [{"cell_type": "bogus"}], "nbformat": 4, '
                                            b'"nbformat_minor": 5, "metadata": {}}', "not")])
def test_bad_bytes_say_why(data, why):
    with pytest.raises(NotANotebook, match=why):
        parse_notebook(data)


def test_untouched_submission_runs_the_release_checks(release):
    run, slots, origin = restore(_sub(release), release)
    assert [(s.id, s.kind, s.edited, s.deleted, s.missing) for s in slots] == [
        ("99.1", "visible", False, False, False)]
    assert run.cells[slots[0].index].source == kernel_code(release.checks["99.1"].source)
    assert origin == list(range(len(release.nb.cells)))
    assert slots[0].key == "99.1"


def _check_index(release):
    return release.checks["99.1"].index


def test_edited_check_is_restored_and_flagged(release):
    def edit(cells):
        cells[_check_index(release)].source = "# Check 99.1 — square\nprint('99.1 passed ✓')"
        cells[_check_index(release)].metadata = {}      # tags dropped too: found by its header
    run, slots, _ = restore(_sub(release, edit), release)
    assert slots[0].edited and run.cells[slots[0].index].source == kernel_code(release.checks["99.1"].source)


def test_deleted_check_is_put_back_in_its_section(release):
    def delete(cells):
        del cells[_check_index(release)]
        cells.append(new_markdown_cell("## Notes\nmy notes"))
        cells.append(new_code_cell("# Check 42.1 — made up\nprint('42.1 passed ✓')",
                                   metadata={"tags": ["check"]}))
    run, slots, origin = restore(_sub(release, delete), release)
    assert slots[0].deleted and not slots[0].missing
    at = _check_index(release)
    assert slots[0].index == at and origin[at] is None  # after the exercise's cells, before the notes
    assert len(slots) == 1                              # the made-up check is not graded


def test_exercise_absent_everywhere_is_missing(release):
    def remove(cells):
        del cells[:]
        cells.append(new_code_cell("x = 1"))
    _, slots, _ = restore(_sub(release, remove), release)
    assert slots[0].missing and slots[0].deleted


def test_duplicate_check_cells_only_first_is_graded_and_hidden_cells_dropped(release):
    def dup(cells):
        cells.insert(_check_index(release), new_code_cell("# Check 99.1 — mine\nprint('99.1 passed ✓')"))
        cells.append(new_code_cell("# Hidden 99.1 — fake\npass", metadata={"tags": ["hidden"]}))
    run, slots, origin = restore(_sub(release, dup), release, hidden={"99.1": "square of large numbers"})
    assert [(s.kind, s.key) for s in slots] == [("visible", "99.1"), ("hidden", "99.1/hidden")]
    assert slots[1].index == slots[0].index + 1
    text = "".join(c.source for c in run.cells)
    assert "fake" not in text and "10**6" not in text        # the hidden source never enters the run
    assert "run_hidden('99.1')" in run.cells[slots[1].index].source


def test_chapter_comes_from_the_content():
    nb = new_notebook(cells=[new_markdown_cell("## Exercise 03.1 — x"), new_markdown_cell("## Exercise 03.2")])
    assert chapter_of(nb, "00_setup_exercises.ipynb") == ("03", "00")
    assert chapter_of(new_notebook(), "alice.ipynb") == (None, None)


def test_forbidden_uses_are_found_through_aliases_and_strings():
    from gpucourse.grading.grade import forbidden_uses

    sources = ["from gpucourse import zero_memory as zm\n", "f = getattr(gc, 'shard_size')",
               "# a comment about reduce_scatter\nx = 'use reduce_scatter here'", "gc.launch(f, 2)"]
    assert forbidden_uses(sources, ["gc.zero_memory", "gc.shard_size", "gc.reduce_scatter"]) == [
        "gc.shard_size", "gc.zero_memory"]


def test_a_cell_too_deep_for_the_parser_hides_no_forbidden_name_and_crashes_nothing():
    """A sum of 60,000 terms made ``ast.parse`` raise RecursionError in the grader's own process: the
    notebook's chapter was "could not be graded" and worth 0 of 0, so it left the student's total
    (found 2026-12-07). Such a cell is now read word by word: a name in it counts."""
    from gpucourse.grading.grade import forbidden_uses

    deep = "_ = " + "+".join(["1"] * 60_000)
    assert forbidden_uses([deep, "gc.launch(f, 2)"], ["gc.zero_memory"]) == []
    assert forbidden_uses([deep + "\nf = gc.zero_memory"], ["gc.zero_memory", "gc.shard_size"]) == ["gc.zero_memory"]
    assert forbidden_uses(["x = 1\0"], ["gc.zero_memory"]) == []          # null bytes: ValueError, cannot run


def test_cells_are_primed_with_inputs_and_values_collected():
    """The engine hands a graded cell its inputs before it runs and takes its values after: whatever
    the cell prints or raises, only the values leave, as data."""
    payload = json.dumps({"cases": wire.dumps([(2,), (3,)]), "seeds": [1, 2], "forbid": []})
    nb = new_notebook(cells=[
        new_code_cell("import gpucourse as gc\ndef square(x):\n    return x * x"),
        new_code_cell("gc.check_exercise('99.1', square, None)\nprint('99.1 passed ✓')\n1 / 0"),
        new_code_cell("gc.check_exercise('99.1', square, None)"),               # not primed: nothing sent
    ])
    record = execute(nb, slots={1: {"slot": "99.1", "payload": payload}}, cwd=".", cell_timeout=60,
                     notebook_timeout=120, output_limit=10000)
    assert wire.loads(record["values"]["99.1"]) == [4, 9]
    assert list(record["values"]) == ["99.1"] and record["cells"][1]["status"] == "error"


def test_output_is_cut_in_the_kernel_and_status_is_the_reply():
    nb = new_notebook(cells=[
        new_code_cell("print('x' * 5_000_000)"),
        new_code_cell("get_ipython().set_custom_exc((Exception,), lambda *a, **k: None)\n"),
        new_code_cell("1 / 0"),
        new_code_cell("print('still runs')"),
    ])
    record = execute(nb, slots={}, cwd=".", cell_timeout=60, notebook_timeout=120, output_limit=1000)
    text = "".join(o.get("text", "") for o in nb.cells[0].outputs)
    assert len(text) < 2000 and "[output truncated by the grader after 1000 characters]" in text
    assert [c["status"] for c in record["cells"]] == ["ok", "ok", "error", "ok"]
    assert not any(o.output_type == "error" for o in nb.cells[2].outputs)    # the display was hidden
    assert record["cells"][2]["error"].startswith("ZeroDivisionError")       # the reply was not


def test_the_shepherd_loads_grading_without_torch():
    """The sandbox's shepherd imports gpucourse/grading on its own: no torch, no other part, and not
    the IRI grammar jsonschema would build for nbformat (0.8 CPU s per notebook graded)."""
    import subprocess
    import sys

    from gpucourse.grading.sandbox import _BOOT, _GRADING_DIR

    code = _BOOT.replace("from gpucourse_grading.sandbox import shepherd_main; shepherd_main()",
                         "import gpucourse_grading.grade, gpucourse_grading.nbgrader, nbclient; "
                         "import gpucourse_grading.engine as e; e._current_env_kernel_manager(); "
                         "print(sorted(m for m in sys.modules if m.split('.')[0] in "
                         "('torch', 'gpucourse', 'lark', 'rfc3987_syntax') and sys.modules[m]))")
    r = subprocess.run([sys.executable, "-c", code, str(_GRADING_DIR)], capture_output=True, text=True,
                       timeout=120, check=True)
    assert r.stdout.strip() == "[]", r.stdout
