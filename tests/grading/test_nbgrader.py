"""`export-nbgrader`: the metadata format, and a round trip through the real nbgrader."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from _grading_helpers import tiny_solutions

from gpucourse.grading.grade import Options, grade
from gpucourse.grading.nbgrader import export_nbgrader, grade_id, to_nbgrader

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = ["00_setup_exercises.ipynb", "03_balanced_data_parallel_exercises.ipynb"]


def test_metadata_format_and_hidden_tests():
    nb = tiny_solutions(hidden=True, points=2)
    nb.cells.append(nbformat.v4.new_code_cell("print('secret')", metadata={"tags": ["solution-only"]}))
    out = to_nbgrader(nb, name="99_tiny_exercises.ipynb")
    meta = [c.metadata.get("nbgrader") for c in out.cells]
    assert all(m and m["schema_version"] == 3 for m in meta)
    answer, check = out.cells[1], out.cells[2]
    assert answer.metadata["nbgrader"] == {"grade": False, "grade_id": "ex99_1-answer", "locked": False,
                                           "schema_version": 3, "solution": True, "task": False}
    assert check.metadata["nbgrader"] == {"grade": True, "grade_id": "ex99_1", "locked": True, "points": 2,
                                          "schema_version": 3, "solution": False, "task": False}
    assert "### BEGIN HIDDEN TESTS\n# Hidden 99.1" in check.source and check.source.endswith(
        "### END HIDDEN TESTS")
    assert len(out.cells) == 3                         # hidden cell folded in, solution-only dropped
    ids = [m["grade_id"] for m in meta]
    assert len(set(ids)) == len(ids) and all(all(ch.isalnum() or ch in "_-" for ch in i) for i in ids)


def test_export_writes_source_assignment(tmp_path):
    written = export_nbgrader(ROOT / "solutions", tmp_path, assignment="week1")
    assert [p.name for p in written] == sorted(p.name for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
    assert all(p.parent == tmp_path / "source" / "week1" for p in written)
    with pytest.raises(FileNotFoundError):
        export_nbgrader(tmp_path / "nothing", tmp_path)


NBGRADER = shutil.which("nbgrader", path=str(Path(sys.executable).parent))


@pytest.mark.slow
@pytest.mark.skipif(NBGRADER is None, reason="nbgrader (test extra, 0.9.x) is not installed")
def test_nbgrader_agrees_with_our_grader(tmp_path):
    sol = tmp_path / "sol"
    sol.mkdir()
    for name in CHAPTERS:
        shutil.copy(ROOT / "solutions" / name, sol / name)
    course = tmp_path / "course"
    export_nbgrader(sol, course, assignment="a1")
    (course / "nbgrader_config.py").write_text('c = get_config()\nc.CourseDirectory.course_id = "gpucourse"\n'
                                               "c.ExecutePreprocessor.timeout = 300\n")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    run = lambda *args: subprocess.run([NBGRADER, *args], cwd=course, env=env, capture_output=True,
                                       text=True, timeout=900)
    r = run("generate_assignment", "a1", "--force")
    assert r.returncode == 0, r.stderr[-2000:]
    ours = tmp_path / "ours"
    for student, folder in (("solved", "source"), ("unsolved", "release")):
        (course / "submitted" / student / "a1").mkdir(parents=True)
        for name in CHAPTERS:
            shutil.copy(course / folder / "a1" / name, course / "submitted" / student / "a1" / name)
            (ours / student).mkdir(parents=True, exist_ok=True)
            shutil.copy(course / folder / "a1" / name, ours / student / name)
    r = run("autograde", "a1", "--create", "--force")
    assert r.returncode == 0, r.stderr[-2000:]
    from nbgrader.api import Gradebook

    theirs = {}
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        for student in ("solved", "unsolved"):
            for nb in gb.find_submission("a1", student).notebooks:
                for g in nb.grades:
                    theirs[(student, g.name)] = g.score == g.max_score
    out = tmp_path / "ours.json"
    grade([str(ours)], release=str(ROOT / "exercises"), workers=2, json_path=str(out),
          options=Options(cell_timeout=300, notebook_timeout=600))
    mine = {(r["student"], grade_id(r["exercise"])): r["visible"] == "✓"
            for r in json.loads(out.read_text())["rows"]}
    assert mine == theirs
    assert all(v for (s, _), v in mine.items() if s == "solved")
    assert not any(v for (s, _), v in mine.items() if s == "unsolved")
