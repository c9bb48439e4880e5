"""`python -m gpucourse check`: the learner's and instructor's grading command."""

import subprocess
import sys

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook


def _nb(solution_body, extra_cells=()):
    return new_notebook(cells=[
        new_markdown_cell("## Exercise 99.1 — square"),
        new_code_cell(f"def square(x):\n    {solution_body}"),
        new_code_cell("# Check 99.1 — square on random inputs\nimport random\n"
                      "for _ in range(20):\n    v = random.randint(-99, 99)\n"
                      "    assert square(v) == v * v, (v, square(v))\nprint('99.1 passed')",
                      metadata={"tags": ["check"]}),
        *extra_cells,
        new_markdown_cell("## Exercise 99.2 — negate"),
        new_code_cell("def neg(x):\n    return -x"),
        new_code_cell("# Check 99.2 — negate\nassert neg(3) == -3", metadata={"tags": ["check"]}),
    ])


def _run(tmp_path, nb, name="sub.ipynb"):
    path = tmp_path / name
    nbformat.write(nb, path)
    return subprocess.run([sys.executable, "-m", "gpucourse", "check", str(path)],
                          capture_output=True, text=True, timeout=180)


def test_completed_notebook_passes(tmp_path):
    r = _run(tmp_path, _nb("return x * x"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "99.1  ✓  square on random inputs" in r.stdout and "2 of 2 checks pass" in r.stdout


@pytest.mark.parametrize("body, error", [
    ('raise NotImplementedError("Exercise 99.1")', "NotImplementedError: Exercise 99.1"),
    ("return 4", "AssertionError"),                 # a constant answer fails
    ("return abs(x) * 2", "AssertionError"),
])
def test_unfinished_or_wrong_notebook_fails_at_its_check(tmp_path, body, error):
    r = _run(tmp_path, _nb(body))
    assert r.returncode == 1
    line = next(l for l in r.stdout.splitlines() if "99.1" in l)
    assert "✗" in line and error in line
    assert "99.2  ✓" in r.stdout                      # the other exercise is still graded


def test_error_in_a_non_check_cell_is_reported(tmp_path):
    r = _run(tmp_path, _nb("return x * x", [new_code_cell("1 / 0")]))
    assert r.returncode == 1 and "(not a check cell) — ZeroDivisionError" in r.stdout


def test_notebook_without_checks_fails(tmp_path):
    r = _run(tmp_path, new_notebook(cells=[new_code_cell("x = 1")]))
    assert r.returncode == 1 and "no check cells" in r.stdout


def test_folder_of_submissions_gives_summary(tmp_path):
    nbformat.write(_nb("return x * x"), tmp_path / "alice.ipynb")
    nbformat.write(_nb("return 0"), tmp_path / "bob.ipynb")
    r = subprocess.run([sys.executable, "-m", "gpucourse", "check", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    summary = r.stdout.split("summary")[1]
    assert "✓  2/2" in summary and "alice.ipynb" in summary
    assert "✗  1/2" in summary and "bob.ipynb" in summary


def test_missing_file(tmp_path):
    r = subprocess.run([sys.executable, "-m", "gpucourse", "check", str(tmp_path / "nope.ipynb")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no such file" in r.stderr


def test_hanging_cell_is_stopped_by_the_cell_timeout(tmp_path):
    nb = _nb("return x * x")
    nb.cells.insert(3, new_code_cell("import time\ntime.sleep(120)"))
    path = tmp_path / "slow.ipynb"
    nbformat.write(nb, path)
    r = subprocess.run([sys.executable, "-m", "gpucourse", "check", "--cell-timeout", "3", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "99.1  ✓" in r.stdout                       # ran before the hang
    assert "99.2  ✗" in r.stdout and "not run: a cell ran longer than 3 s" in r.stdout


def test_stored_outputs_of_an_unrun_check_do_not_count_as_passed(tmp_path):
    """A shipped exercises notebook stores the solution's check output; a check the run never
    reached (here: after a hanging cell) must be graded as not run, not as passed."""
    nb = _nb("return x * x")
    nb.cells.insert(3, new_code_cell("import time\ntime.sleep(120)"))
    for count, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        cell.execution_count = count + 1          # as stored by the solution run
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="99.x passed\n")]
    path = tmp_path / "stale.ipynb"
    nbformat.write(nb, path)
    r = subprocess.run([sys.executable, "-m", "gpucourse", "check", "--cell-timeout", "3", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "99.1  ✓" in r.stdout
    assert "99.2  ✗" in r.stdout and "not run: a cell ran longer than 3 s" in r.stdout
