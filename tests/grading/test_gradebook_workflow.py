"""Issue 39: a class graded the way an instructor works, and a gradebook that adds up.

Each test grades a class of the tiny chapter-99 release (seconds) or needs no notebook run at all:

* a chapter handed in twice is graded one way (the release's file name wins; other copies are
  ignored, and listed; "duplicate" only when no file has that name), and the maximum never counts a
  chapter twice;
* ``grade`` finds the course's release wherever it is run from, and says which it used;
* a gradebook holding other students is never silently replaced: refused, or merged with --update;
* ``--totals`` writes one line per student for an LMS; the JSON says when and with what it was made;
* the same seed gives the same gradebook, byte for byte but for the date and the timings;
* ``--chapter NN`` on a folder of several chapters grades that chapter's notebooks only;
* the student data and grades the README writes into the checkout stay out of git;
* a learner far from a checkout (a JupyterHub home, an nbgrader assignment) is told what works
  there, ``gc.check_this_notebook()``, and it finds the course's release (nbgrader's own
  config is tested in test_nbgrader.py).
"""

import contextlib
import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import nbformat
from _grading_helpers import TINY, tiny_solutions, tiny_submission

from gpucourse.grading.exercises import make_exercise_notebook
from gpucourse.grading.grade import Options, Submission, discover, grade
from gpucourse.grading.restore import load_releases

ROOT = Path(__file__).resolve().parents[2]
OPTS = dict(cell_timeout=60, notebook_timeout=120)
COPY1 = TINY.replace(".ipynb", "-Copy1.ipynb")
COPY2 = TINY.replace(".ipynb", "-Copy2.ipynb")


def _hand_in(subs: Path, student: str, name: str, answer: str) -> Path:
    """``subs/student/name``: the tiny release with ``answer`` as square's body."""
    path = tiny_submission(subs, "_scratch", answer)
    (subs / student).mkdir(parents=True, exist_ok=True)
    target = subs / student / name
    path.rename(target)
    path.parent.rmdir()
    return target


def _grade(paths, rel, sol, **kw) -> tuple[int, dict, str]:
    """(exit status, the JSON gradebook, what was printed); stderr is appended to what was printed."""
    out = io.StringIO()
    json_path = kw.pop("json_path")
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = grade([str(p) for p in paths], release=str(rel), solutions=str(sol), workers=2,
                     json_path=str(json_path), options=Options(**OPTS), **kw)
    path = Path(json_path)
    return code, json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}, out.getvalue()


def _mine(data, student):
    return [r for r in data["rows"] if r["student"] == student]


def _line(stdout: str, student: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith(student + " "))


def test_copies_of_a_chapter_are_graded_one_way(tiny_release, tmp_path):
    rel, sol = tiny_release
    subs = tmp_path / "subs"
    _hand_in(subs, "dan", TINY, "return x * x")            # the final notebook
    _hand_in(subs, "dan", COPY1, "return 0")               # Jupyter's duplicate, a draft
    _hand_in(subs, "eve", COPY1, "return x * x")           # two copies, neither named like the release
    _hand_in(subs, "eve", COPY2, "return x * x")
    _hand_in(subs, "gus", "homework.ipynb", "return x * x")   # named like no course notebook
    code, data, stdout = _grade([subs], rel, sol, json_path=tmp_path / "g.json")

    dan = _mine(data, "dan")
    graded = [r for r in dan if r["status"] == "graded"]
    assert [r["notebook"] for r in graded] == [TINY] and graded[0]["points"] == 3, dan
    ignored, = [r for r in dan if r["status"] == "ignored"]
    assert ignored["notebook"] == COPY1 and ignored["max"] == 0 and TINY in ignored["error"], ignored
    assert sum(r["max"] for r in dan) == 3                                   # never the chapter twice
    assert f"ignored {COPY1}" in _line(stdout, "dan") and "3/3" in _line(stdout, "dan")

    eve = _mine(data, "eve")
    assert sum(r["points"] for r in eve) == 0 and sum(r["max"] for r in eve) == 3, eve
    assert {r["status"] for r in eve} == {"duplicate"}
    assert all(COPY1 in r["error"] and COPY2 in r["error"] for r in eve), eve

    gus = _mine(data, "gus")
    assert [(r["notebook"], r["points"], r["max"]) for r in gus] == [("homework.ipynb", 3, 3)], gus
    assert "homework.ipynb: chapter 99 by its exercise ids" in _line(stdout, "gus")
    note, = [n["note"] for n in data["notebooks"] if n["student"] == "gus"]
    assert "by its exercise ids" in note
    assert code == 2                                  # eve's chapter could not be graded


def test_the_notes_a_students_file_names_make_are_shown_escaped():
    from gpucourse.grading.gradebook import Row, summary_table

    copy = "99_tiny_exercises\nbob      3/3     1/1.ipynb"          # a file name may hold a newline
    rows = [Row("dan", TINY, "99.1", "square", "✓", "", 3, 3, 0.1, "", "", "graded"),
            Row("dan", copy, "-", copy, "", "", 0, 0, 0.0, "ignored: …", "", "ignored",
                note="x\x1b[2J.ipynb: chapter 99 by its exercise ids")]
    table = summary_table(rows).splitlines()
    assert len(table) == 2 and not any(line.startswith("bob") for line in table), table
    assert "ignored 99_tiny_exercises\\nbob" in table[1] and "x\\x1b[2J.ipynb" in table[1], table


def test_one_per_chapter_without_running_anything(tiny_release, tmp_path):
    from gpucourse.grading.grade import one_per_chapter

    rel, _ = tiny_release
    releases = load_releases(rel)
    data = (rel / TINY).read_bytes()

    def sub(student, name, **kw):
        return Submission(student, tmp_path / student / name, data, **kw)

    class_ = [sub("ann", COPY1), sub("ann", TINY), sub("bo", COPY2), sub("bo", COPY1),
              sub("cy", TINY, problem="not graded: zoe/x is in a folder inside cy's folder"),
              sub("cy", TINY), sub("flat", "flat.ipynb")]
    kept, left_out = one_per_chapter(class_, releases)
    assert left_out == []
    by = {(s.student, s.path.name): s for s in kept}
    assert by[("ann", TINY)].problem == "" and by[("ann", TINY)].carries
    assert by[("ann", COPY1)].problem.startswith("ignored") and not by[("ann", COPY1)].carries
    assert [by[("bo", n)].problem.startswith("duplicate") for n in (COPY2, COPY1)] == [True, True]
    assert [by[("bo", n)].carries for n in (COPY2, COPY1)] == [True, False]      # the chapter once
    readable, = [s for s in kept if s.student == "cy" and not s.problem]
    assert readable.carries and sum(s.carries for s in kept if s.student == "cy") == 1
    assert by[("flat", "flat.ipynb")].note == ""          # a flat class's file is its student: no note
    # discovery itself no longer decides (it does not know the release's names)
    (tmp_path / "dan").mkdir()
    for name in (TINY, COPY1):
        (tmp_path / "dan" / name).write_bytes(data)
    assert [s.problem for s in discover([str(tmp_path / "dan")])] == ["", ""]


def _cli(*args, cwd, timeout=300) -> subprocess.CompletedProcess:
    """``python -m gpucourse …`` with this checkout's package, run from ``cwd``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "gpucourse", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_grade_finds_the_course_release_from_any_folder(tiny_release, tmp_path):
    rel, _ = tiny_release
    subs, elsewhere = tmp_path / "subs", tmp_path / "elsewhere"
    (subs / "alice").mkdir(parents=True)
    elsewhere.mkdir()
    (subs / "alice" / "00_setup_exercises.ipynb").write_bytes(b'{"cells": [')     # truncated: no kernel runs
    r = _cli("grade", subs, "--json", "g.json", cwd=elsewhere)
    assert r.returncode == 2, r.stdout + r.stderr
    first = (r.stdout.splitlines() or [""])[0]
    assert first.startswith(f"release: {ROOT / 'exercises'} (chapters 00, 01"), r.stdout + r.stderr
    rows = json.loads((elsewhere / "g.json").read_text())["rows"]
    assert rows and {row["exercise"][:3] for row in rows} == {"00."}, rows
    assert {row["status"] for row in rows} == {"unreadable"}
    # --release still overrides
    (subs / "alice" / "00_setup_exercises.ipynb").rename(subs / "alice" / TINY)
    r = _cli("grade", subs, "--release", rel, "--json", "h.json", cwd=elsewhere)
    assert r.stdout.splitlines()[0] == f"release: {rel.resolve()} (chapter 99)", r.stdout + r.stderr
    assert [row["exercise"] for row in json.loads((elsewhere / "h.json").read_text())["rows"]] == ["99.1"]


def test_a_gradebook_of_other_students_is_refused_or_updated_never_replaced(tiny_release, tmp_path):
    rel, sol = tiny_release
    subs = tmp_path / "subs"
    table, book = tmp_path / "class.csv", tmp_path / "class.json"
    tiny_submission(subs, "ann", "return x * x")
    tiny_submission(subs, "bob", "return 0")
    table.write_text("name,score\nann,3\n")                  # something else, where the gradebook goes
    code, _, out = _grade([subs], rel, sol, json_path=book, csv_path=str(table))
    assert code == 2 and "not a CSV gradebook" in out and table.read_text() == "name,score\nann,3\n", out
    assert not book.exists()                                  # refused before anything was graded
    table.unlink()
    code, first, _ = _grade([subs], rel, sol, json_path=book, csv_path=str(table), seed=5)
    assert code == 1
    tiny_submission(subs, "bob", "return x * x")                # bob hands in a fix
    before = table.read_bytes(), book.read_bytes()
    code, _, out = _grade([subs / "bob"], rel, sol, json_path=book, csv_path=str(table))
    assert code == 2 and str(table) in out and "1 student(s) not graded in this run (ann)" in out, out
    assert (table.read_bytes(), book.read_bytes()) == before                          # untouched
    code, data, out = _grade([subs / "bob"], rel, sol, json_path=book, csv_path=str(table), update=True, seed=6)
    assert code == 0, out
    assert f"updated {table}: 1 student(s) regraded (bob); 1 kept as they were" in out, out
    assert f"updated {book}: 1 student(s) regraded (bob); 1 kept as they were" in out, out
    old_lines = before[0].decode().splitlines()
    new_lines = table.read_text().splitlines()
    assert new_lines[0] == old_lines[0] and [l for l in new_lines if l.startswith("ann,")] == \
        [l for l in old_lines if l.startswith("ann,")]                                  # ann's rows kept
    assert [(r["student"], r["points"]) for r in data["rows"]] == [("ann", 3), ("bob", 3)]
    assert [n["student"] for n in data["notebooks"]] == ["ann", "bob"]
    assert data["seed"] == 6 and [(e["seed"], e["students"]) for e in data["earlier_runs"]] == [(5, ["ann"])]
    assert first["rows"][0] == data["rows"][0]


def test_totals_for_an_lms_and_the_gradebooks_provenance(tiny_release, tmp_path):
    import gpucourse
    from datetime import datetime

    rel, sol = tiny_release
    subs = tmp_path / "subs"
    tiny_submission(subs, "ann", "return x * x")
    tiny_submission(subs, "bob", "return 0")
    (subs / "=1+2").mkdir()
    (subs / "=1+2" / TINY).write_bytes(b'{"cells": [')        # unreadable: 0 of 3
    totals = tmp_path / "totals.csv"
    code, data, _ = _grade([subs], rel, sol, json_path=tmp_path / "g.json", totals_path=str(totals), seed=7)
    assert code == 2
    lines = totals.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "student,points,max,percent"
    assert sorted(csv.reader(lines[1:])) == [["'=1+2", "0", "3", "0"], ["ann", "3", "3", "100"],
                                             ["bob", "0", "3", "0"]]
    assert datetime.fromisoformat(data["date"]).tzinfo is not None
    assert data["course"]["version"] == gpucourse.__version__
    assert data["course"]["release"] == str(rel.resolve())
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert data["course"]["commit"] == head.stdout.strip()
    else:
        assert "commit" not in data["course"]
    assert data["grader"]["version"] and data["grader"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert data["seed"] == 7 and data["isolation"]


def test_no_commit_is_recorded_outside_a_git_checkout(tmp_path):
    from gpucourse.grading.grade import _course_commit

    assert _course_commit(tmp_path) is None                   # not a checkout of its own
    assert _course_commit(ROOT / "gpucourse") is None          # inside one, but not its top


#: what may differ between two runs with one seed: when it ran and how long things took
TIMING = {"date": None, "rows": {"seconds"}, "notebooks": {"wall_seconds", "span_seconds", "phases"}}


def _without_timing(data: dict) -> dict:
    data = {k: v for k, v in data.items() if k != "date"}
    for key, fields in (("rows", TIMING["rows"]), ("notebooks", TIMING["notebooks"])):
        data[key] = [{k: v for k, v in item.items() if k not in fields} for item in data[key]]
    return data


RANKS_FAIL = """def no_data(rank, world_size):
    raise ValueError(f"rank {rank} has no data")


gc.launch(no_data, 2)"""


def test_the_same_seed_gives_the_same_gradebook(tiny_release, tmp_path):
    rel, sol = tiny_release
    subs = tmp_path / "subs"
    tiny_submission(subs, "ann", "return x * x")
    # a wrong answer, a cell error, and ranks that all fail at once (which one reports first is a race)
    tiny_submission(subs, "bob", "return x * x if x < 3 else x", extra=["1 / 0", RANKS_FAIL])
    tiny_submission(subs, "cy", "raise ValueError(f'no square for {x}')")
    (subs / "dee").mkdir()
    (subs / "dee" / TINY).write_bytes(b'{"cells": [')
    texts = []
    for k in range(2):
        code, _, _ = _grade([subs], rel, sol, json_path=tmp_path / f"g{k}.json", seed=11,
                            csv_path=str(tmp_path / f"g{k}.csv"), totals_path=str(tmp_path / f"t{k}.csv"))
        assert code == 2
        texts.append((tmp_path / f"g{k}.json").read_text(encoding="utf-8"))
    first, second = (json.loads(t) for t in texts)
    assert set(first) == set(second)
    assert json.dumps(_without_timing(first), indent=1) == json.dumps(_without_timing(second), indent=1)
    assert (tmp_path / "t0.csv").read_bytes() == (tmp_path / "t1.csv").read_bytes()
    tables = [[{k: v for k, v in row.items() if k != "seconds"}
               for row in csv.DictReader((tmp_path / f"g{k}.csv").read_text(encoding="utf-8").splitlines())]
              for k in range(2)]
    assert tables[0] == tables[1] and len(tables[0]) == 4
    bob, = [n for n in first["notebooks"] if n["student"] == "bob"]
    assert any("rank 0 raised ValueError: rank 0 has no data" in e for e in bob["other_errors"]), bob


LEAVE_TWO = """import subprocess, sys
stay = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=new)
        for new in (False, True)]"""


def test_processes_killed_after_counts_what_the_notebook_left_running_and_only_that(tiny_release, tmp_path):
    # the kernel itself is stopped after every notebook, and a process that had ended already (a
    # failed rank its launcher had not reaped yet) left nothing running: neither counts; a process
    # that outlives a first SIGKILL for a moment counts once. This count used to read 1 for every
    # notebook (the kernel), 2 now and then on a loaded machine.
    rel, sol = tiny_release
    subs = tmp_path / "subs"
    tiny_submission(subs, "ann", "return x * x")
    tiny_submission(subs, "bob", "return x * x", extra=[RANKS_FAIL])
    tiny_submission(subs, "eve", "return x * x", extra=[LEAVE_TWO])
    code, data, out = _grade([subs], rel, sol, json_path=tmp_path / "g.json")
    assert code == 0, out                       # all three answers are right
    bob, = [n for n in data["notebooks"] if n["student"] == "bob"]
    assert any("rank 0 has no data" in e for e in bob["other_errors"]), bob
    left = {n["student"]: n["processes_killed_after"] for n in data["notebooks"]}
    assert left == {"ann": 0, "bob": 0, "eve": 2}, left


def test_chapter_selects_that_chapters_notebooks_in_a_folder_of_several(tiny_release, tmp_path):
    rel, sol = tiny_release
    other = TINY.replace("99", "98")
    nb = tiny_solutions()
    for cell in nb.cells:
        cell.source = cell.source.replace("99", "98")
    nbformat.write(make_exercise_notebook(nb, name=other), rel / other)     # the release: chapters 98, 99
    subs = tmp_path / "subs"
    tiny_submission(subs, "ann", "return x * x")
    for student in ("ann", "bob"):                     # each hands in chapter 98 too; bob only that one
        (subs / student).mkdir(exist_ok=True)
        (subs / student / other).write_bytes((rel / other).read_bytes())
    code, data, out = _grade([subs], rel, sol, json_path=tmp_path / "g.json", chapter="99")
    assert code == 0, out
    assert [(r["student"], r["exercise"], r["points"], r["max"]) for r in data["rows"]] == [("ann", "99.1", 3, 3)]
    assert "left out 2 notebook(s) of other chapters (--chapter 99): ann/98_tiny_exercises.ipynb, bob/98_" in out
    assert "3/3" in _line(out, "ann")
    code, _, out = _grade([subs], rel, sol, json_path=tmp_path / "h.json", chapter="42")
    assert code == 2 and "--chapter 42: the release has no such chapter (chapters: 98, 99)" in out, out


def test_student_data_and_grades_written_into_the_checkout_stay_out_of_git():
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    # the README's own names: make grade's grades.json, --csv grades.csv, --feedback feedback/,
    # --totals totals.csv, grade subs/cat --csv class.csv, export-nbgrader course/
    private = ["subs/alice/00_setup_exercises.ipynb", "subs/bob.ipynb", "grades.json", "grades.csv",
               "totals.csv", "class.csv", "feedback/alice.md", "course/gradebook.db",
               "course/submitted/alice/00_setup/00_setup_exercises.ipynb"]
    r = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", *private],
                       capture_output=True, text=True)
    assert sorted(r.stdout.split()) == sorted(private), r.stdout + r.stderr
    course = ["exercises/00_setup_exercises.ipynb", "tests/grading/test_grade.py", "gpucourse/grading/grade.py"]
    r = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", *course], capture_output=True, text=True)
    assert r.stdout == "", r.stdout


def test_the_self_check_finds_the_course_release_far_from_a_checkout(tmp_path, monkeypatch):
    from gpucourse.grading.selfcheck import _find_releases

    home = tmp_path / "home" / "00_setup"                     # a JupyterHub home: no exercises/ around
    home.mkdir(parents=True)
    monkeypatch.chdir(home)
    releases = _find_releases(home / "00_setup_exercises.ipynb", None)
    assert "00" in releases and releases["00"].path.parent == ROOT / "exercises", releases


def test_the_release_notebooks_say_what_checks_a_notebook_anywhere():
    for path in sorted((ROOT / "exercises").glob("[0-9][0-9]_*.ipynb")):
        intro = nbformat.read(path, as_version=4).cells[0].source
        assert "run `gc.check_this_notebook()` in a cell of it. That works wherever the" in intro, path.name
        assert "your JupyterHub home" in intro and "In a checkout of\nthe course a terminal" in intro, path.name
        assert f"make check NB=exercises/{path.name}" in intro, path.name


def test_a_notebook_the_grader_fails_on_is_worth_0_of_its_chapters_points(tiny_release, tmp_path, monkeypatch):
    """Where grading a notebook raises inside the grader (a parser's RecursionError did, on a cell of
    60,000 terms), the notebook is one "could not be graded" row per exercise, each worth 0 of its
    points: it used to be one row worth 0 of 0, and the chapter left the student's total."""
    from gpucourse.grading import grade as grade_module

    def fails(sub, *args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(grade_module, "grade_notebook", fails)
    rel, sol = tiny_release
    subs = tmp_path / "subs"
    tiny_submission(subs, "ann", "return x * x")
    code, data, out = _grade([subs], rel, sol, json_path=tmp_path / "g.json", totals_path=str(tmp_path / "t.csv"))
    assert code == 2, out
    rows = _mine(data, "ann")
    assert [(r["exercise"], r["points"], r["max"], r["status"]) for r in rows] == [("99.1", 0, 3, "unreadable")], rows
    assert "could not be graded: RecursionError" in rows[0]["error"]
    assert "ann,0,3,0" in (tmp_path / "t.csv").read_text()
