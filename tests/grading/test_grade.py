"""`python -m gpucourse grade`: a class of cheating, broken and honest submissions is graded right.

The corpus is generated from the shipped exercises (tests/grading/make_corpus.py); every row of
issue 13's table is in it. The attacks of issue 28 (every grading mode, six chapters) are in
``test_attacks.py``.
"""

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nbformat
import pytest
from _grading_helpers import tiny_submission
from make_corpus import EXPECTED, write

from gpucourse.grading.grade import Options, grade
from gpucourse.grading.sandbox import isolation

ROOT = Path(__file__).resolve().parents[2]
HAVE_BWRAP = isolation() == "bwrap"
NO_BWRAP = "bwrap (Debian package bubblewrap) is not installed or does not work here"


def _rows(path):
    return json.loads(Path(path).read_text())["rows"]


@pytest.fixture(scope="module")
def graded_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    subs = root / "subs"
    write(subs)
    out = root / "grades.json"
    code = grade([str(subs)], release=str(ROOT / "exercises"), workers=2, json_path=str(out),
                 csv_path=str(root / "grades.csv"), feedback=str(root / "feedback"),
                 options=Options(cell_timeout=120, notebook_timeout=300))
    return code, _rows(out), root


@pytest.mark.slow
@pytest.mark.parametrize("student", sorted(EXPECTED))
def test_corpus_row(graded_corpus, student):
    _, rows, _ = graded_corpus
    points, status, flags = EXPECTED[student]
    mine = [r for r in rows if r["student"] == student]
    assert mine, f"{student} has no row"
    # the rows' reasons first: a dict's repr is cut short in pytest's summary
    why = [f'{r["exercise"]} {r["status"]}: {r.get("error", "")[:200]}' for r in mine]
    assert sum(r["points"] for r in mine) == points, why
    assert {r["status"] for r in mine} == {status}, why
    text = json.dumps(mine, ensure_ascii=False)
    for flag in flags:
        assert flag in text, (flag, mine)


@pytest.mark.slow
def test_corpus_exit_status_csv_and_feedback(graded_corpus):
    code, rows, root = graded_corpus
    assert code == 2                                  # unreadable submissions are input errors
    header = (root / "grades.csv").read_text().splitlines()[0]
    assert header == "student,notebook,exercise,title,visible,hidden,points,max,seconds,error,restored,status"
    feedback = (root / "feedback" / "deleted_check.md").read_text()
    assert "00.1" in feedback and "deleted" in feedback and "NotImplementedError" in feedback


def test_hidden_checks_points_and_feedback(tiny_release, tmp_path, capsys):
    rel, sol = tiny_release
    subs = tmp_path / "subs"
    tiny_submission(subs, "good", "return x * x")
    # a plausible wrong answer: right on the visible check's small inputs, wrong on large ones
    tiny_submission(subs, "planted", "return x * x if abs(x) < 100 else 0")
    out = tmp_path / "g.json"
    code = grade([str(subs)], release=str(rel), hidden_from=str(sol), workers=2, json_path=str(out),
                 feedback=str(tmp_path / "fb"), options=Options(cell_timeout=60, notebook_timeout=120))
    seed = json.loads(out.read_text())["seed"]
    rows = {r["student"]: r for r in _rows(out)}
    assert code == 1
    assert rows["good"]["visible"] == "✓" and rows["good"]["hidden"] == "✓"
    assert rows["good"]["points"] == rows["good"]["max"] == 3                       # points metadata
    assert rows["planted"]["visible"] == "✓" and rows["planted"]["hidden"] == "✗"
    assert rows["planted"]["points"] == 0 and rows["planted"]["max"] == 3           # both must pass
    fb = (tmp_path / "fb" / "planted.md").read_text()
    assert "hidden check of 99.1" in fb and "square(1000000)" in fb     # which case failed, and how
    assert "hidden_cases" not in fb and "10**6" not in fb               # never the hidden source
    assert isinstance(seed, int) and f"seed {seed}" in fb


def test_all_passed_exits_0_and_usage_exits_2(tiny_release, tmp_path):
    rel, sol = tiny_release
    subs = tmp_path / "subs"
    tiny_submission(subs, "good", "return x * x")
    opts = Options(cell_timeout=60, notebook_timeout=120)
    assert grade([str(subs)], release=str(rel), solutions=str(sol), workers=1, options=opts) == 0
    assert grade([str(tmp_path / "nope")], release=str(rel), solutions=str(sol), options=opts) == 2
    assert grade([str(subs)], release=str(rel), solutions=str(tmp_path / "nope"), options=opts) == 2
    r = subprocess.run([sys.executable, "-m", "gpucourse", "grade", str(subs), "--workers", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--workers" in r.stderr


def test_workers_are_concurrent_and_budget_holds(tiny_release, tmp_path):
    rel, sol = tiny_release
    subs = tmp_path / "subs"
    for s in ("a", "b"):
        tiny_submission(subs, s, "return x * x", extra=["import time\ntime.sleep(6)"])
    tiny_submission(subs, "slow", "return x * x", extra=["import time\ntime.sleep(4)"] * 5, before=True)
    out = tmp_path / "g.json"
    grade([str(subs)], release=str(rel), solutions=str(sol), workers=3, json_path=str(out),
          options=Options(cell_timeout=60, notebook_timeout=12))
    rows = {r["student"]: r for r in _rows(out)}
    assert rows["a"]["visible"] == rows["b"]["visible"] == "✓"
    assert rows["slow"]["visible"] == "✗" and "budget of 12 s" in rows["slow"]["error"], rows["slow"]
    # each notebook sleeps for seconds: one after another, each would begin after the one before ended;
    # at once, all three are being graded at one moment (a machine's speed moves the spans, not that)
    spans = [n["span_seconds"] for n in json.loads(out.read_text())["notebooks"]]
    assert all(0 <= b < e for b, e in spans), spans
    assert max(b for b, _ in spans) < min(e for _, e in spans), f"{spans}: the workers did not run at once"


def test_huge_output_is_truncated_and_graded(tiny_release, tmp_path):
    rel, sol = tiny_release
    subs = tmp_path / "subs"
    tiny_submission(subs, "loud", "return x * x", extra=["print('x' * 100_000_000)"])
    out = tmp_path / "g.json"
    grade([str(subs)], release=str(rel), solutions=str(sol), workers=1, json_path=str(out),
          options=Options(cell_timeout=60, notebook_timeout=120))
    row = _rows(out)[0]
    assert row["visible"] == "✓", row


def _alive(marker: str) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                    pids.append(int(name))
            except OSError:
                pass
    return pids


ESCAPE = """import os, subprocess, time
subprocess.Popen(["sleep", "{m1}"], start_new_session=True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execvp("sleep", ["sleep", "{m2}"])
    os._exit(0)
time.sleep(0.5)"""


@pytest.mark.parametrize("bwrap", [False, pytest.param(True, marks=pytest.mark.skipif(
    not HAVE_BWRAP, reason=NO_BWRAP))])
def test_no_process_outlives_its_notebook(tiny_release, tmp_path, bwrap):
    rel, sol = tiny_release
    subs = tmp_path / "subs"
    m1, m2 = f"600.{uuid.uuid4().int % 10**6}", f"601.{uuid.uuid4().int % 10**6}"
    tiny_submission(subs, "escaper", "return x * x", extra=[ESCAPE.format(m1=m1, m2=m2)])
    try:
        grade([str(subs)], release=str(rel), solutions=str(sol), workers=1,
              options=Options(cell_timeout=60, notebook_timeout=120, use_bwrap=bwrap))
        time.sleep(0.5)
        assert _alive(m1) == [] and _alive(m2) == []
    finally:
        for p in _alive(m1) + _alive(m2):
            os.kill(p, 9)


@pytest.mark.skipif(not HAVE_BWRAP, reason=NO_BWRAP)
def test_sandbox_blocks_other_files_outside_writes_and_network(tiny_release, tmp_path):
    rel, sol = tiny_release
    subs = tmp_path / "subs"
    victim = tiny_submission(subs, "victim", "return x * x")
    before = victim.read_bytes()
    outside = tmp_path / "outside.txt"
    server = socket.socket()
    server.bind(("0.0.0.0", 0))
    server.listen()
    server.settimeout(0.5)
    port = server.getsockname()[1]
    attack = f"""import socket
for path in [{str(victim)!r}, {str(outside)!r}]:
    try:
        open(path, "w").write("{{}}")
    except OSError as e:
        print("blocked", path, e)
for host in ["127.0.0.1"] + socket.gethostbyname_ex(socket.gethostname())[2]:
    try:
        socket.create_connection((host, {port}), timeout=1).close()
        print("connected", host)
    except OSError as e:
        print("no network", host, e)"""
    tiny_submission(subs, "attacker", "return x * x", extra=[attack])
    out = tmp_path / "g.json"
    grade([str(subs)], release=str(rel), solutions=str(sol), workers=2, json_path=str(out),
          options=Options(cell_timeout=60, notebook_timeout=120))
    rows = {r["student"]: r for r in _rows(out)}
    assert rows["victim"]["visible"] == "✓" and victim.read_bytes() == before
    assert not outside.exists()
    with pytest.raises(socket.timeout):
        server.accept()
    server.close()


def test_console_script_and_help():
    script = Path(sys.executable).parent / "gpucourse"
    if not script.exists():
        pytest.skip("the gpucourse console script is not installed in this environment")
    r = subprocess.run([str(script), "grade", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    for flag in ("--release", "--hidden", "--workers", "--csv", "--json", "--feedback", "--cell-timeout",
                 "--notebook-timeout"):
        assert flag in r.stdout


def test_check_this_notebook_from_a_cell(tiny_release, tmp_path, monkeypatch, capsys):
    import gpucourse as gc

    rel, sol = tiny_release
    monkeypatch.setenv("GPUCOURSE_SOLUTIONS", str(sol))
    path = tiny_submission(tmp_path / "subs", "me", "return x * x")
    (tmp_path / "subs" / "me" / "exercises").symlink_to(rel)       # the release next to the notebook
    monkeypatch.setenv("JPY_SESSION_NAME", str(path))
    verdict = gc.check_this_notebook()
    assert bool(verdict) is True and verdict == True  # noqa: E712 - the comparison is the point
    out = capsys.readouterr().out
    assert "99.1  ✓" in out and "1 of 1 checks pass" in out
    bad = tiny_submission(tmp_path / "subs", "me", "return 0")
    assert bool(gc.check(bad)) is False
    # left in the notebook, the call is not a failing cell of the notebook when it is checked
    again = tiny_submission(tmp_path / "subs", "me", "return x * x", extra=["gc.check_this_notebook()"])
    monkeypatch.delenv("GPUCOURSE_SOLUTIONS")
    from gpucourse.grading.selfcheck import check_notebook

    results = check_notebook(again, solutions=str(sol), release=str(rel))
    assert [(r.label, r.passed) for r in results] == [("99.1", True)], [(r.label, r.error) for r in results]
    monkeypatch.setenv("GPUCOURSE_SOLUTIONS", str(sol))
    monkeypatch.delenv("JPY_SESSION_NAME")
    with pytest.raises(RuntimeError, match="gc.check"):
        gc.check_this_notebook()


def test_shipped_exercises_look_unsolved_and_say_what_a_pass_prints():
    from gpucourse.grading.exercises import check_hash

    for path in sorted((ROOT / "exercises").glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        assert nb.metadata["gpucourse"]["chapter"] == path.name[:2]
        text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
        assert "python -m gpucourse check" not in text.replace(".venv/bin/python -m gpucourse check", "")
        for cell in nb.cells:
            if cell.cell_type != "code":
                continue
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: stored output"
            if "check" in cell.metadata.get("tags", []):
                meta = cell.metadata["gpucourse"]
                assert meta["hash"] == check_hash(cell.source)
                assert f"check cell prints `{meta['exercise']} passed ✓`" in text


def test_file_size_limit_applies_to_the_notebook(tiny_release, tmp_path):
    from gpucourse.grading.grade import Judges, Submission, grade_notebook
    from gpucourse.grading.restore import load_releases
    from gpucourse.grading.sandbox import Limits

    rel, sol = tiny_release
    path = tiny_submission(tmp_path / "subs", "big", "return x * x",
                           extra=["open('big.bin', 'wb').write(b'0' * 3_000_000)"])
    judges = Judges(str(sol), seed=1)
    try:
        g = grade_notebook(Submission("big", path, path.read_bytes()), load_releases(rel), judges=judges,
                           hidden=False, options=Options(cell_timeout=60, notebook_timeout=120,
                                                         limits=Limits(file_bytes=1 << 20)),
                           mode=isolation(), work_root=tmp_path)
    finally:
        judges.close()
    assert g.rows[0].visible == "✓"
    assert any("File too large" in err for _, err in g.others), g.others


def test_grade_refuses_to_run_unsandboxed_unless_told(tiny_release, tmp_path, monkeypatch, capsys):
    """Without bwrap a submission could read the answers: grade refuses, --no-bwrap overrides."""
    from gpucourse.grading import grade as grade_module

    rel, sol = tiny_release
    tiny_submission(tmp_path / "subs", "good", "return x * x")
    monkeypatch.setattr(grade_module, "isolation", lambda use_bwrap=True: "limits")
    opts = Options(cell_timeout=60, notebook_timeout=120)
    assert grade([str(tmp_path / "subs")], release=str(rel), solutions=str(sol), options=opts) == 2
    assert "bubblewrap" in capsys.readouterr().err
    assert grade([str(tmp_path / "subs")], release=str(rel), solutions=str(sol), options=opts,
                 allow_unisolated=True) == 0


def test_the_recorded_seed_reproduces_a_grade(tiny_release, tmp_path):
    """Inputs come from the grader's seed (recorded in the gradebook): the same seed, the same
    verdict and message; another seed, other inputs."""
    rel, sol = tiny_release
    subs = tmp_path / "subs"
    tiny_submission(subs, "flaky", "return x * x if abs(x) <= 3 or x % 2 == 0 else -1")   # wrong on some inputs
    opts = Options(cell_timeout=60, notebook_timeout=120)
    errors = []
    for seed in (3, 3, 4):
        out = tmp_path / f"g{len(errors)}.json"
        grade([str(subs)], release=str(rel), solutions=str(sol), options=opts, json_path=str(out), seed=seed)
        data = json.loads(out.read_text())
        assert data["seed"] == seed
        errors.append(data["rows"][0]["error"])
    assert errors[0] == errors[1] and errors[0] != errors[2]


def test_grader_process_never_imports_torch(tmp_path):
    """The grader only reads, restores and schedules notebooks (their kernels import torch): `import
    gpucourse` is lazy, and neither the grading modules, nor `grade` on a class, nor `exercises
    --check` load torch in the grader's process. The first `gc.<name>` of a part then does."""
    (tmp_path / "alice").mkdir()
    (tmp_path / "alice" / "00_setup_exercises.ipynb").write_bytes(b'{"cells": [')     # truncated
    code = (
        "import sys, gpucourse, gpucourse.grading.grade, gpucourse.grading.nbgrader, gpucourse.__main__\n"
        "from gpucourse.__main__ import main\n"
        f"graded = main(['grade', {str(tmp_path)!r}, '--release', {str(ROOT / 'exercises')!r}])\n"
        f"stale = main(['exercises', '--check', '--solutions', {str(ROOT / 'solutions')!r},"
        f" '--exercises', {str(ROOT / 'exercises')!r}])\n"
        "before = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "gpucourse.TinyGPT\n"
        "print(graded, stale, len(before), 'torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "2 0 0 True", r.stdout + r.stderr


def test_students_come_from_folders_in_every_form_of_the_command_line(tmp_path):
    """`grade subs/`, `grade subs/*`, single files and flat folders all name the same students."""
    from gpucourse.grading.grade import discover

    subs = tmp_path / "subs"
    for student in ("alice", "bob"):
        (subs / student).mkdir(parents=True)
        (subs / student / "00_setup_exercises.ipynb").write_text("{}")
        (subs / student / "03_balanced_data_parallel_exercises.ipynb").write_text("{}")
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "carol.ipynb").write_text("{}")
    (flat / "dave.ipynb").write_text("{}")
    every = {("alice", "00"), ("alice", "03"), ("bob", "00"), ("bob", "03")}

    def students(args):
        return {(s.student, s.path.name[:2]) for s in discover([str(a) for a in args])}

    assert students([subs]) == every
    assert students(sorted(subs.iterdir())) == every                       # subs/* from a shell
    assert students(sorted(subs.glob("*/*.ipynb"))) == every              # subs/*/*.ipynb
    assert students([subs / "alice" / "00_setup_exercises.ipynb"]) == {("alice", "00")}
    assert {s.student for s in discover([str(flat)])} == {"carol", "dave"}
    assert {s.student for s in discover(sorted(map(str, flat.iterdir())))} == {"carol", "dave"}
    assert len(discover([str(subs), str(subs / "alice")])) == 4              # a file named twice: once


def test_a_chapter_handed_in_twice_grades_the_release_named_one(tmp_path):
    """The copy is ignored, not graded (it sorts first); without the release's name: duplicate.
    tests/grading/test_gradebook_workflow.py grades such a class."""
    from gpucourse.grading.grade import discover, one_per_chapter
    from gpucourse.grading.restore import load_releases

    releases = load_releases(ROOT / "exercises")
    for student, names in (("alice", ["00_setup_exercises.ipynb", "00_setup_exercises (copy).ipynb"]),
                           ("bob", ["00_setup_exercises (copy).ipynb", "00_setup_exercises-Copy1.ipynb"])):
        (tmp_path / student).mkdir()
        for name in names:
            (tmp_path / student / name).write_text("{}")
    subs, _ = one_per_chapter(discover([str(tmp_path)]), releases)
    assert [(s.student, s.problem.split(":")[0], s.carries) for s in subs] == [
        ("alice", "ignored", False), ("alice", "", True), ("bob", "duplicate", True), ("bob", "duplicate", False)]


def test_an_unreadable_notebook_scores_zero_of_its_chapter_and_is_named(tmp_path, capsys):
    subs = tmp_path / "subs"
    (subs / "alice").mkdir(parents=True)
    (subs / "alice" / "00_setup_exercises.ipynb").write_bytes(b'{"cells": [{"cell_type": "code", "sou')
    out, fb = tmp_path / "g.json", tmp_path / "fb"
    code = grade([str(subs)], release=str(ROOT / "exercises"), json_path=str(out), feedback=str(fb),
                 options=Options(cell_timeout=60, notebook_timeout=120))
    rows = _rows(out)
    assert code == 2
    ids = [c for c in nbformat.read(ROOT / "exercises" / "00_setup_exercises.ipynb", as_version=4).cells
           if "check" in c.metadata.get("tags", [])]
    assert [r["exercise"] for r in rows] == [f"00.{k}" for k in range(1, len(ids) + 1)]
    assert sum(r["max"] for r in rows) == len(ids)
    assert all(r["points"] == 0 and r["status"] == "unreadable" for r in rows)
    assert "00_setup_exercises.ipynb" in rows[0]["error"] and "at at" not in rows[0]["error"]
    text = (fb / "alice.md").read_text()
    assert f"0 / {len(ids)}" in text and "00_setup_exercises.ipynb" in text
    assert "gradebook written to" in capsys.readouterr().out


def test_html_feedback_is_rendered_and_escapes_what_a_student_printed(tmp_path):
    from gpucourse.grading.gradebook import Row, write_feedback

    rows = [Row("eve", "00_setup_exercises.ipynb", "00.1", "mean", "✗", "", 0, 1, 0.5,
                "00.1, case 1 of 2: expected <b>1</b>", "edited", "graded",
                message="00.1 failed\n<script>alert('x')</script>\n| a | b |")]
    path, = write_feedback(rows, tmp_path, fmt="html")
    page = path.read_text()
    assert "<table>" in page and "<pre>" not in page.split("<h2")[0]          # a real table, not raw text
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "<b>1</b>" not in page and "&lt;b&gt;1&lt;/b&gt;" in page
    # the judge's text is shown as code (issue 37: no link or image from a student's text is rendered)
    assert "check cell edited — restored; <code>00.1" in page and "restored; |" not in page


def test_judges_started_in_the_background_live_until_closed(tiny_release):
    """grade starts every chapter's judge, and draws its references, in a background thread. A
    sandboxed judge dies with the *thread* that started it (``bwrap --die-with-parent``), so that
    thread must stay until the judges close: when it ended after drawing, the judge was killed under
    a worker's request, and an honest notebook was "not graded" (benchmarks/grading.py caught it)."""
    from gpucourse.grading.grade import Judges

    rel, sol = tiny_release
    judges = Judges(str(sol), seed=1, private_network=isolation(True) == "bwrap")
    try:
        judges.start(["99"], hidden=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            judge = judges._judges.get("99")
            if judge is not None and all(s["slot"] in judges._cases for s in judge.hello["slots"]):
                break
            time.sleep(0.1)
        else:
            pytest.fail("the judge did not start and draw within 120 s")
        time.sleep(1.0)                               # the drawing is over: the thread would end here
        assert judge.proc.poll() is None, "the judge died with the thread that started it"
        assert judge.request({"op": "hello"})["slots"] == judge.hello["slots"]
    finally:
        judges.close()
    assert judge.proc.poll() is not None                # closed: nothing left running
