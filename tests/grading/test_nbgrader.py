"""`export-nbgrader`: the metadata format, and one class graded the same by real nbgrader and `grade`."""

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
from gpucourse.grading.sandbox import isolation

ROOT = Path(__file__).resolve().parents[2]
CHAPTER = "00_setup_exercises.ipynb"


def test_metadata_format_and_no_hidden_tests():
    nb = tiny_solutions(hidden=True, points=2)
    nb.cells.append(nbformat.v4.new_code_cell("print('secret')", metadata={"tags": ["solution-only"]}))
    out = to_nbgrader(nb, name="99_tiny_exercises.ipynb")
    meta = [c.metadata.get("nbgrader") for c in out.cells]
    assert all(m and m["schema_version"] == 3 for m in meta)
    answer = next(c for c in out.cells if c.source.startswith("def square"))
    check = next(c for c in out.cells if c.source.startswith("# Check"))
    assert answer.metadata["nbgrader"] == {"grade": False, "grade_id": "ex99_1-answer", "locked": False,
                                           "schema_version": 3, "solution": True, "task": False}
    assert check.metadata["nbgrader"] == {"grade": True, "grade_id": "ex99_1", "locked": True, "points": 2,
                                          "schema_version": 3, "solution": False, "task": False}
    text = "".join(c.source for c in out.cells)
    assert "Hidden" not in text and "HIDDEN TESTS" not in text and "secret" not in text
    ids = [m["grade_id"] for m in meta]
    assert len(set(ids)) == len(ids) and all(all(ch.isalnum() or ch in "_-" for ch in i) for i in ids)


def test_export_one_assignment_per_chapter_and_a_config(tmp_path):
    written = export_nbgrader(tmp_path)                          # finds the course's solutions itself
    chapters = sorted(p.name for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
    assert [p.name for p in written] == chapters
    assert {p.parent.name for p in written} == {n.removesuffix("_exercises.ipynb") for n in chapters}
    config = (tmp_path / "nbgrader_config.py").read_text()
    assert 'course_id = "gpucourse"' in config and "GPUCOURSE_HIDDEN_CHECKS" in config
    assert str(tmp_path.resolve()) not in config and str(ROOT) not in config        # no absolute path
    (tmp_path / "nbgrader_config.py").write_text("# mine\n")
    some = export_nbgrader(tmp_path / "x", chapters=["03", "00"], assignment="week1")
    assert [p.relative_to(tmp_path / "x").as_posix() for p in some] == [
        "source/week1/00_setup_exercises.ipynb", "source/week1/03_balanced_data_parallel_exercises.ipynb"]
    # each chapter's public cases travel with the assignment, byte for byte: students check on them
    for chapter in ("00", "03"):
        shipped = tmp_path / "x" / "source" / "week1" / "public" / f"{chapter}_public_cases.json"
        assert shipped.read_bytes() == (ROOT / "exercises" / "public" / shipped.name).read_bytes()
    export_nbgrader(tmp_path, chapters=["00"])
    assert (tmp_path / "nbgrader_config.py").read_text() == "# mine\n"            # never overwritten
    with pytest.raises(ValueError, match="no chapter 42"):
        export_nbgrader(tmp_path, chapters=["42"])
    with pytest.raises(FileNotFoundError):
        export_nbgrader(tmp_path, solutions=tmp_path / "nothing")


#: prints what nbgrader reads from the config in the folder argv[1]: root, course id, solutions
LOAD_CONFIG = """
import os, sys
from traitlets.config.loader import PyFileConfigLoader
cfg = PyFileConfigLoader("nbgrader_config.py", path=sys.argv[1]).load_config()
print(cfg.CourseDirectory.root, cfg.CourseDirectory.course_id, os.environ.get("GPUCOURSE_SOLUTIONS", "-"))
"""


def _read_config(course: Path) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "GPUCOURSE_SOLUTIONS"}
    r = subprocess.run([sys.executable, "-c", LOAD_CONFIG, str(course)], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_the_config_names_no_absolute_path_takes_the_course_id_and_moves_with_its_folder(tmp_path):
    from gpucourse.__main__ import main

    here = tmp_path / "here"
    (here / "solutions").mkdir(parents=True)
    nbformat.write(tiny_solutions(hidden=True), here / "solutions" / "99_tiny_exercises.ipynb")
    assert main(["export-nbgrader", str(here / "course"), "--solutions", str(here / "solutions"),
                 "--course-id", "cs-101"]) == 0
    text = (here / "course" / "nbgrader_config.py").read_text()
    assert str(tmp_path) not in text and str(tmp_path.resolve()) not in text and str(ROOT) not in text, text
    assert 'c.CourseDirectory.course_id = "cs-101"' in text
    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    here.rename(moved)                                     # the course and its solutions, moved together
    root, course_id, solutions = _read_config(moved / "course")
    assert (Path(root), course_id) == (moved / "course", "cs-101")
    assert Path(solutions).resolve() == (moved / "solutions").resolve()
    # the course's own solutions: the judge finds them next to the package, nothing is written
    export_nbgrader(tmp_path / "plain", chapters=["00"])
    assert _read_config(tmp_path / "plain") == [str(tmp_path / "plain"), "gpucourse", "-"]


#: builds generate_feedback's exporter from the config in argv[1], as nbgrader 0.9 does, and prints
#: the preprocessors and what traitlets logged
FEEDBACK_EXPORTER = """
import io, logging, sys
from traitlets.config.loader import PyFileConfigLoader
from nbgrader.converters import GenerateFeedback
from nbgrader.coursedir import CourseDirectory
cfg = PyFileConfigLoader("nbgrader_config.py", path=sys.argv[1]).load_config()
log = io.StringIO()
logging.getLogger("traitlets").addHandler(logging.StreamHandler(log))
feedback = GenerateFeedback(coursedir=CourseDirectory(config=cfg), config=cfg)
exporter = feedback.exporter_class(parent=feedback, config=feedback.config)
for pp in feedback.preprocessors:
    exporter.register_preprocessor(pp)
print(" ".join(type(p).__name__ for p in exporter._preprocessors))
print(log.getvalue())
"""


def test_the_feedback_config_sets_no_option_a_preprocessor_does_not_take(tmp_path):
    """nbconvert's HTML exporter sets ``NbConvertBase.display_data_priority`` for all its
    preprocessors; nbgrader's ``ClearHiddenTests`` does not take it, so listing it in
    ``GenerateFeedback.preprocessors`` made every generate_feedback warn "Config option
    display_data_priority not recognized by ClearHiddenTests"."""
    pytest.importorskip("nbgrader")
    export_nbgrader(tmp_path, chapters=["00"])
    r = subprocess.run([sys.executable, "-c", FEEDBACK_EXPORTER, str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "GetGrades" in r.stdout and "not recognized" not in r.stdout + r.stderr, r.stdout + r.stderr


NBGRADER = shutil.which("nbgrader", path=str(Path(sys.executable).parent))


def _class(release: Path) -> dict[str, object]:
    """student → the notebook they hand in: honest, blank, and one with a wrong answer and a deleted
    check (one notebook for both: each is a whole chapter-00 run in nbgrader and in grade)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from make_corpus import _answers

    def filled(nb):
        answers = iter(_answers(CHAPTER))
        for cell in nb.cells:
            if cell.cell_type == "code" and cell.metadata.get("nbgrader", {}).get("solution"):
                cell.source = next(answers)
        return nb

    blank = nbformat.read(release, as_version=4)
    honest = filled(nbformat.read(release, as_version=4))
    wrong = filled(nbformat.read(release, as_version=4))
    for cell in wrong.cells:                         # 00.2: Python's negative indexing (cuda:-1 visible)
        if cell.source.startswith("def physical_gpu"):
            cell.source = ("def physical_gpu(spec, logical):\n    ids = [int(x) for x in spec.split(',') if x.strip()]\n"
                           "    if logical >= len(ids):\n        raise IndexError(logical)\n    return ids[logical]")
    wrong.cells = [c for c in wrong.cells if not c.source.startswith("# Check 00.3")]
    return {"honest": honest, "blank": blank, "wrong": wrong}


@pytest.mark.slow
@pytest.mark.skipif(NBGRADER is None, reason="nbgrader (test extra, 0.9.x) is not installed")
@pytest.mark.skipif(isolation() != "bwrap", reason="grade needs bwrap (Debian package bubblewrap)")
def test_nbgrader_and_grade_give_the_same_points_exercise_by_exercise(tmp_path):
    course = tmp_path / "course"
    export_nbgrader(course, chapters=["00"])
    assignment = "00_setup"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    run = lambda *args: subprocess.run([NBGRADER, *args], cwd=course, env=env, capture_output=True,
                                       text=True, timeout=900)
    r = run("generate_assignment", assignment, "--force")
    assert r.returncode == 0, r.stderr[-3000:]
    ours = tmp_path / "ours"
    for student, nb in _class(course / "release" / assignment / CHAPTER).items():
        for folder in (course / "submitted" / student / assignment, ours / student):
            folder.mkdir(parents=True)
            nbformat.write(nb, folder / CHAPTER)
    r = run("autograde", assignment, "--create", "--force")
    assert r.returncode == 0, r.stderr[-3000:]
    log = r.stdout + r.stderr
    assert "has changed" not in log, log[-3000:]                 # no checksum noise on untouched cells
    assert log.count("Missing grade cell ex00_3") == 1, log[-3000:]   # the deleted check, put back
    assert "SAWarning" not in log, log[-3000:]
    r = run("generate_feedback", assignment, "--force")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "not recognized" not in r.stdout + r.stderr, r.stderr[-3000:]
    feedback = "".join(p.read_text() for p in (course / "feedback").rglob("*.html"))
    assert "check_hidden" not in feedback and "BEGIN HIDDEN TESTS" not in feedback
    # a failed check shows the judge's message under the student's cell, not the grading machine's paths
    assert "CheckFailed" in feedback and "harness.py" not in feedback and "site-packages" not in feedback
    from nbgrader.api import Gradebook

    theirs = {}
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        for student in ("honest", "blank", "wrong"):
            for nb in gb.find_submission(assignment, student).notebooks:
                for g in nb.grades:
                    theirs[(student, g.name)] = g.score
    out = tmp_path / "ours.json"
    grade([str(ours)], release=str(ROOT / "exercises"), hidden_from=str(ROOT / "solutions"), workers=2,
          json_path=str(out), options=Options(cell_timeout=300, notebook_timeout=600))
    mine = {(r["student"], grade_id(r["exercise"])): r["points"] for r in json.loads(out.read_text())["rows"]}
    assert mine == theirs
    assert [mine[("honest", g)] for g in ("ex00_1", "ex00_2", "ex00_3")] == [1, 1, 1]
    # 00.2 wrong; 00.3's deleted check put back both ways, and its answer earns its point
    assert [mine[("wrong", g)] for g in ("ex00_1", "ex00_2", "ex00_3")] == [1, 0, 1]
    assert sum(v for (s, _), v in mine.items() if s == "blank") == 0
